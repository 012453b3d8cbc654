"""The objectives table: every pretraining objective, once, and what each consumer needs to know about it.

An objective is a plan (``plans.py``) plus a few facts that collators, decoders, evaluators, model cards and the
CLIs ask about. They read them here and nowhere else, so registering an objective means one :class:`Objective`
in :data:`OBJECTIVES` (and its plan function).

Families, after the papers' concepts:

- ``look_ahead`` (AR, semi-AR): groups follow the text order, so the content stream is causal at group
  granularity; such checkpoints continue text with group decoding (``generate(group_size=t)``).
- ``any_order`` (GVP): groups follow a random order over positions; the condition group is bidirectional, so
  such checkpoints fill any set of positions (infilling).
- ``masked`` ("look around", BERT/MAE): one hidden group predicted from the visible rest; infilling, and a
  classic single-stream ``[MASK]`` form.
- ``mixture`` (UL2's mixture of denoisers): not a family of its own plans; each sequence gets the plan of one
  component objective, drawn from weights, and the checkpoint has what each component family gives.

A mixture objective (a collator draws one objective per sequence from weights) fits the same shape: its plan
function takes the components and their weights as ``plan_params`` (``{"mixture": {name: weight},
"components": {name: plan params}}``), and the questions below (:func:`decoders`, :func:`families`,
:func:`max_target_ratio`, :func:`default_attention`, :func:`card_text`) answer from the components it records.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Objective", "OBJECTIVES", "PLAN_NAMES", "FAMILIES", "LOOK_AHEAD", "ANY_ORDER", "MASKED", "MIXTURE",
           "get", "family", "families", "names", "decoders", "default_plan_params", "max_target_ratio",
           "default_attention", "card_text", "mixture_components"]

LOOK_AHEAD, ANY_ORDER, MASKED, MIXTURE = "look_ahead", "any_order", "masked", "mixture"
FAMILIES = (LOOK_AHEAD, ANY_ORDER, MASKED, MIXTURE)
# the decoders of generation.py: group decoding (semi-AR, through the query stream) and any-order infilling
GROUP_DECODING, INFILLING = "group", "infill"
# the card templates of hub/cards.py (cards/*.md)
TWO_STREAM_CARD, MASKED_CARD = "two-stream", "masked"


@dataclass(frozen=True)
class Objective:
    name: str
    plan_function: str  # the name of its function in plans.py: f(lengths, seq_len, ..., generator=None) -> Plan
    family: str
    title: str  # the objective's name on a model card
    card_text: str  # its plan in words, for the card
    image_defaults: dict | None = None  # plan parameters for images (None: not an image objective)
    # an upper bound on the fraction of a sequence that carries a loss, from the plan parameters (None: all of it)
    target_ratio: Callable[[dict], float] | None = None

    @property
    def plan(self) -> Callable:
        # plans.py reads this table (make_plan), so the table names its functions instead of importing them
        return getattr(importlib.import_module(".plans", __package__), self.plan_function)

    @property
    def defaults(self) -> dict:
        """The plan parameters the plan function uses when none are given (text)."""
        ignored = {"lengths", "seq_len", "generator", "maskable", "num_condition_tokens"}
        return {
            name: p.default for name, p in inspect.signature(self.plan).parameters.items()
            if name not in ignored and p.default is not inspect.Parameter.empty
        }

    @functools.cached_property
    def takes_maskable(self) -> bool:
        """Whether its plan takes ``maskable`` (positions that may be masked: special tokens never are)."""
        return "maskable" in inspect.signature(self.plan).parameters

    @property
    def decoders(self) -> tuple[str, ...]:
        if self.family == MIXTURE:
            return ()  # those of its components: see decoders(name, params)
        return (GROUP_DECODING,) if self.family == LOOK_AHEAD else (INFILLING,)

    @property
    def card_template(self) -> str:
        return MASKED_CARD if self.family == MASKED else TWO_STREAM_CARD

    @property
    def default_attention(self) -> str:
        """The single-stream pattern a checkpoint of this objective uses without a plan (config.default_attention)."""
        return "causal" if self.family == LOOK_AHEAD else "bidirectional"


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective(
        "ar", "autoregressive_plan", LOOK_AHEAD, "autoregressive (AR, \"look ahead\")",
        "`g[i] = i`: each token is predicted from the tokens before it; targets are positions `i >= 1`.",
    ),
    Objective(
        "dar", "semi_autoregressive_plan", LOOK_AHEAD,
        "diversity-enhanced autoregressive / semi-autoregressive (DAR)",
        "the first group, of size `s1 ~ U{1..t}`, has rank 0; then consecutive groups of `t` tokens: "
        "`g[i] = 1 + (i - s1) // t`; a group is predicted from all earlier groups (paper (a) Eq. 3 and 6).",
    ),
    Objective(
        "mlm", "masked_plan", MASKED, "masked, fixed ratio (\"look around\", BERT/MAE)",
        "unmasked tokens have rank 0, masked tokens rank 1; the masked tokens are predicted from the rest.",
        image_defaults={"mask_ratio": 0.75},
        target_ratio=lambda params: params.get("mask_ratio", 0.15),
    ),
    Objective(
        "vmlm", "variable_masked_plan", MASKED, "variable-length masked (VMLM)",
        "as masked, with the ratio drawn per sequence from `U[a, b]` (paper (a) Eq. 5).",
        image_defaults={"mask_ratio_range": (0.5, 0.75)},
        target_ratio=lambda params: max(params.get("mask_ratio_range", (0.15, 0.3))),
    ),
    Objective(
        "gvp", "gvp_plan", ANY_ORDER, "grouped permuted prediction (GVP)",
        "a random order over positions is cut into groups G0..GK; G0 is the condition and each later group "
        "is predicted from all earlier ones (paper (b) §3.2).",
        image_defaults={"num_groups": 20, "segmentation": "mixed"},
    ),
    Objective(
        "mixture", "mixture_plan", MIXTURE, "mixture of objectives (UL2-style mixture of denoisers)",
        "each sequence gets the plan of one component objective, drawn from normalised weights (seeded per "
        "batch); the components are trained together on one backbone.",
        target_ratio=lambda params: max(
            max_target_ratio(name, component) for name, component in mixture_components(params).items()),
    ),
)}
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


def mixture_components(params: dict | None) -> dict[str, dict]:
    """A mixture's components with their plan parameters (``{name: params}``, in the order of the table), from the
    mixture's ``plan_params``: the weighted names (``params["mixture"]``, the default mixture when absent) and their
    parameters (``params["components"]``; a component not listed there uses its defaults)."""
    params = params or {}
    weights = params.get("mixture") or DEFAULT_MIXTURE
    given = params.get("components") or {}
    return {name: dict(given.get(name) or {}) for name in OBJECTIVES if float(weights.get(name, 0)) > 0}


# the mixture drawn when none is given: semi-AR (t = 2) and variable-length masking, half each
DEFAULT_MIXTURE = {"dar": 0.5, "vmlm": 0.5}


def families(name: str | None, params: dict | None = None) -> tuple[str, ...]:
    """The families a checkpoint of ``name`` was trained on: its own, or its components' for a mixture."""
    if name not in OBJECTIVES:
        return ()
    if OBJECTIVES[name].family != MIXTURE:
        return (OBJECTIVES[name].family,)
    found = [OBJECTIVES[c].family for c in mixture_components(params)]
    return tuple(f for f in FAMILIES if f in found)


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
    components = mixture_components(params)
    parts = []
    for component, component_params in components.items():
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
