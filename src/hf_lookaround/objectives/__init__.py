"""The objectives: one module per objective in this folder, and the table built from them.

An objective module (``ar.py``, ``dar.py``, ...) defines ``OBJECTIVE``, an :class:`~.base.Objective`: its plan
function, its parameters dataclass (defaults, validation, help: the fields are its command-line flags), its
collator, and the facts that the CLI, decoders, evaluators, model cards, the demo and the study ask about. They
read them here and nowhere else, so adding an objective means adding one module (and its test file).

The table lists every module of this folder, ordered by family (look-ahead, masked, any-order, mixture), then
by name.
"""

import importlib
import math
import pkgutil

from .base import (
    ANY_ORDER,
    CAUSAL_HEAD,
    DEFAULT_MIXTURE,
    FAMILIES,
    FORMS,
    GROUP_DECODING,
    INFILLING,
    LOOK_AHEAD,
    MASKED,
    MASKED_CARD,
    MASKED_HEAD,
    MIXTURE,
    SINGLE_STREAM,
    TWO_STREAM,
    TEXT_CARD,
    Objective,
    ObjectiveParams,
)

__all__ = ["Objective", "ObjectiveParams", "OBJECTIVES", "PLAN_NAMES", "FAMILIES", "FORMS", "LOOK_AHEAD",
           "ANY_ORDER", "MASKED", "MIXTURE", "TWO_STREAM", "SINGLE_STREAM", "get", "family", "families", "names",
           "decoders", "default_plan_params", "max_target_ratio", "default_attention", "card_text",
           "mixture_components", "diffusion_components", "make_plan", "make_collator", "max_targets", "max_content_rows", "presets",
           "DEFAULT_MIXTURE"]

_NOT_OBJECTIVES = {"base"}


def _discover() -> dict[str, Objective]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _NOT_OBJECTIVES:
            found.append(importlib.import_module(f"{__name__}.{info.name}").OBJECTIVE)
    found.sort(key=lambda o: (FAMILIES.index(o.family), o.name))
    return {o.name: o for o in found}


OBJECTIVES: dict[str, Objective] = _discover()
PLAN_NAMES = tuple(OBJECTIVES)


def get(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {PLAN_NAMES}")
    return OBJECTIVES[name]


def family(name: str | None) -> str | None:
    """The family of ``name``; None for no objective (or one this table does not know)."""
    return OBJECTIVES[name].family if name in OBJECTIVES else None


def names(*families: str, images: bool = False) -> tuple[str, ...]:
    """The objectives of the given families (all of them by default); ``images``: those with image defaults."""
    return tuple(
        name for name, o in OBJECTIVES.items()
        if (not families or o.family in families) and (not images or o.image_defaults is not None)
    )


def presets() -> dict[str, tuple[str, str, dict]]:
    """Every objective's named settings (the rows of the demo and the study): ``{row: (objective, description,
    {flag: value})}``, in the table's order."""
    return {row: (name, description, dict(flags))
            for name, o in OBJECTIVES.items() for row, (description, flags) in o.presets.items()}


def mixture_components(params: dict | None) -> dict[str, dict]:
    """A mixture's components with their plan parameters (``{name: params}``, in the order of the table), from the
    mixture's ``plan_params``: the weighted names (``params["mixture"]``, the default mixture when absent) and their
    parameters (``params["components"]``; a component not listed there uses its defaults)."""
    params = params or {}
    weights = params.get("mixture") or DEFAULT_MIXTURE
    given = params.get("components") or {}
    return {name: dict(given.get(name) or {}) for name in OBJECTIVES if float(weights.get(name, 0)) > 0}


def families(name: str | None, params: dict | None = None) -> tuple[str, ...]:
    """The families a checkpoint of ``name`` was trained on: its own, or its components' for a mixture."""
    if name not in OBJECTIVES:
        return ()
    if OBJECTIVES[name].family != MIXTURE:
        return (OBJECTIVES[name].family,)
    found = [OBJECTIVES[c].family for c in mixture_components(params)]
    return tuple(f for f in FAMILIES if f in found)


def diffusion_components(name: str | None, params: dict | None = None) -> dict[str, dict]:
    """The diffusion objectives (those with an ``elbo_plan``) a checkpoint of ``name`` was trained on, with the plan
    parameters each trained with (``{name: params}``): the objective itself with ``params``, a mixture's diffusion
    components with their own parameters (``params["components"]``), else none."""
    if name not in OBJECTIVES:
        return {}
    if OBJECTIVES[name].family != MIXTURE:
        return {name: dict(params or {})} if OBJECTIVES[name].elbo_plan is not None else {}
    return {c: p for c, p in mixture_components(params).items() if OBJECTIVES[c].elbo_plan is not None}


def decoders(name: str | None, params: dict | None = None) -> tuple[str, ...] | None:
    """The decoders a checkpoint of ``name`` was trained for (a mixture: those of its components, from ``params``,
    its ``plan_params``); None when no objective is recorded."""
    if name not in OBJECTIVES:
        return None
    if OBJECTIVES[name].family != MIXTURE:
        return OBJECTIVES[name].decoders
    found = {d for c in mixture_components(params) for d in OBJECTIVES[c].decoders}
    return tuple(d for d in (GROUP_DECODING, INFILLING) if d in found)


def default_attention(name: str, params: dict | None = None) -> str:
    """``config.default_attention`` for a checkpoint of ``name``: a mixture with a look-ahead component is causal
    (as its perplexity protocol, the AR plan), else bidirectional."""
    if get(name).family != MIXTURE:
        return get(name).default_attention
    return "causal" if LOOK_AHEAD in families(name, params) else "bidirectional"


def card_text(name: str, params: dict | None = None) -> str:
    """The plan in words for a model card; a mixture names its components and their normalised weights."""
    entry = get(name)
    if entry.family != MIXTURE:
        return entry.card_text
    weights = (params or {}).get("mixture") or DEFAULT_MIXTURE
    total = float(sum(weights.values())) or 1.0
    parts = []
    for component, component_params in mixture_components(params).items():
        shown = ", ".join(f"{k}={v}" for k, v in sorted(component_params.items()))
        parts.append(f"`{component}` ({get(component).title}) with weight {weights[component] / total:.3g}"
                     + (f" ({shown})" if shown else ""))
    protocol = ("Perplexity uses the AR plan (`p(x_k | x_<k)` in one forward), as for a (semi-)autoregressive "
                "checkpoint, since the mixture has a look-ahead component." if LOOK_AHEAD in families(name, params)
                else "Perplexity uses the masked-prefix protocol, as for a masked checkpoint.")
    return f"{entry.card_text} Components: {'; '.join(parts)}. {protocol}"


def default_plan_params(name: str | None) -> dict:
    return OBJECTIVES[name].defaults if name in OBJECTIVES else {}


def max_target_ratio(name: str, params: dict) -> float:
    """An upper bound on the fraction of positions that carry a loss (1.0: every position may)."""
    ratio = get(name).target_ratio
    return 1.0 if ratio is None else float(ratio(params))


def make_plan(objective: str, lengths, seq_len: int, generator=None, **params):
    """Draw the plan of ``objective`` with its parameters."""
    return get(objective).plan(lengths, seq_len, generator=generator, **params)


def make_collator(objective: str, tokenizer=None, **params):
    """The collator of ``objective`` with its parameters. Parameters that another objective uses are rejected, so a
    typo does not silently do nothing."""
    cls = get(objective).collator
    allowed = {f.name for f in cls.__dataclass_fields__.values() if f.init}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"{cls.__name__} ({objective}) takes no parameter(s) {sorted(unknown)}; it takes {sorted(allowed)}")
    return cls(tokenizer=tokenizer, **params)


def max_targets(objective: str, seq_len: int, **params) -> int:
    """An upper bound on the number of loss positions per sequence: a static ``pad_targets_to``."""
    return max(1, math.ceil(max_target_ratio(objective, params) * seq_len))


def max_content_rows(objective: str, seq_len: int, **params) -> int | None:
    """An upper bound on the content rows a sequence keeps when the rows no prediction reads are dropped
    (``--drop_unread_content``): its top rank holds at least ``min_top_ratio`` of it. None: no useful bound (GVP's
    last group may hold a single token)."""
    least = get(objective).min_top_ratio
    return None if least is None else math.ceil(seq_len * (1 - float(least(params))))
