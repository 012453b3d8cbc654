"""``mixture``: a mixture of objectives (UL2's mixture of denoisers).

Each sequence gets the plan of one component objective, drawn from normalised weights (seeded per batch); the
components are trained together on one backbone. The plan parameters are ``{"mixture": {name: weight},
"components": {name: plan params}}``, and what the checkpoint was trained for (decoders, families, the loss
fraction) is that of its components.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..data.collators import PlanCollator
from ..plans import Plan, check_lengths
from .base import MIXTURE, Objective, ObjectiveParams, flag

# the mixture drawn when none is given: semi-AR (t = 2) and variable-length masking, half each
DEFAULT_MIXTURE = {"dar": 0.5, "vmlm": 0.5}


def _table():
    from . import OBJECTIVES  # the objectives table imports this module

    return OBJECTIVES


def check_mixture(mixture=None, components=None) -> tuple[dict[str, float], dict[str, dict]]:
    """A mixture's normalised weights ``{name: weight}`` and its components' plan parameters ``{name: params}``
    (both in the order of the objectives table), or a ValueError that says what to fix.

    ``mixture``: ``{name: weight}`` (weights >= 0, any positive total; default ``DEFAULT_MIXTURE``);
    ``components``: ``{name: plan params}`` for some of them (the others use their plan's defaults)."""
    weights = dict(DEFAULT_MIXTURE if mixture is None else mixture)
    if not weights:
        raise ValueError("a mixture needs at least one component, e.g. mixture={'dar': 0.5, 'vmlm': 0.5}")
    choices = tuple(n for n, o in _table().items() if o.family != MIXTURE)
    for name, weight in weights.items():
        if name not in _table():
            raise ValueError(f"mixture: unknown objective {name!r}; components are objectives of {choices}")
        if _table()[name].family == MIXTURE:
            raise ValueError(f"mixture: a component cannot itself be a mixture ({name!r}); list its components instead")
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"mixture: the weight of {name!r} must be a number, got {weight!r}") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mixture: the weight of {name!r} must be a finite number >= 0, got {weight}")
        weights[name] = weight
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"mixture: the weights {weights} sum to 0; give at least one component a positive weight")
    components = dict(components or {})
    extra = sorted(set(components) - set(weights))
    if extra:
        raise ValueError(f"mixture: parameters are given for {extra}, which are not components of {sorted(weights)}")
    checked = {}
    for name in _table():
        if name not in weights:
            continue
        params = dict(components.get(name) or {})
        try:  # the component's own plan checks its parameters (on an empty batch: nothing is drawn)
            _table()[name].plan([0], 0, **params)
        except TypeError as error:
            raise ValueError(f"mixture: component {name!r} takes no such parameter ({error}); it takes "
                             f"{sorted(_table()[name].defaults)}") from None
        except ValueError as error:
            raise ValueError(f"mixture: component {name!r}: {error}") from None
        checked[name] = params
    return {name: weights[name] / total for name in checked}, checked


def draw_mixture_components(batch: int, weights: dict[str, float], generator=None) -> torch.Tensor:
    """(B,) long: the index (into ``weights``' order) of the component drawn for each row."""
    probs = torch.tensor(list(weights.values()), dtype=torch.float64)
    if len(weights) == 1:
        return torch.zeros(batch, dtype=torch.long)
    return torch.multinomial(probs, batch, replacement=True, generator=generator)


def plan(
    lengths,
    seq_len: int,
    mixture: dict | None = None,
    components: dict | None = None,
    num_condition_tokens: int = 0,
    maskable=None,
    generator=None,
    checked: bool = False,
) -> Plan:
    """A mixture of objectives (UL2's mixture of denoisers): each row gets the plan of one component, drawn from the
    normalised weights ``mixture`` (``{name: weight}``); ``components`` holds each component's plan parameters.
    ``checked``: they are what :func:`check_mixture` returned (a collator checks them once, not every batch).

    Vectorised per component: the rows are grouped by the component drawn, each component's plan is drawn once for
    its rows (with the same generator, components in table order), and the plans are scattered back. ``maskable``
    goes to the components whose plan takes it (the masked ones)."""
    weights, params = (mixture, components) if checked else check_mixture(mixture, components)
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    batch = lengths.numel()
    drawn = draw_mixture_components(batch, weights, generator).numpy()
    # rows are gathered and scattered in numpy: torch's index kernels run multi-threaded on the host and take
    # milliseconds when its cores are busy (compile workers, data loaders), numpy's microseconds
    group_ids = np.zeros((batch, seq_len), dtype=np.int64)
    is_target = np.zeros((batch, seq_len), dtype=bool)
    if maskable is not None:
        maskable = torch.as_tensor(maskable, dtype=torch.bool).numpy()
    for index, name in enumerate(weights):
        rows = np.flatnonzero(drawn == index)
        if rows.size == 0:
            continue
        extra = dict(params[name])
        if maskable is not None and _table()[name].takes_maskable:
            extra["maskable"] = torch.from_numpy(maskable[rows])
        plan_ = _table()[name].plan( lengths.numpy()[rows], seq_len, generator=generator,
                                     num_condition_tokens=num_condition_tokens, **extra)
        group_ids[rows] = plan_.group_ids.numpy()
        is_target[rows] = plan_.is_target.numpy()
    group_ids, is_target = torch.from_numpy(group_ids), torch.from_numpy(is_target)
    return Plan(group_ids, is_target)


def mixture_row_components(lengths, seq_len: int, mixture=None, components=None, generator=None) -> list[str]:
    """The component each row of :func:`mixture_plan` with this generator state gets (its first draw)."""
    weights, _ = check_mixture(mixture, components)
    names = list(weights)
    return [names[i] for i in draw_mixture_components(len(torch.as_tensor(lengths).flatten()), weights, generator)]


def parse_weights(items) -> dict[str, float]:
    """``--mixture dar=0.5 vmlm=0.5`` as ``{name: weight}`` (as given, not yet normalised)."""
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--mixture: {item!r} is not NAME=WEIGHT; write e.g. --mixture dar=0.5 vmlm=0.5")
        if name in weights:
            raise ValueError(f"--mixture: {name!r} is given twice; list each component once")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"--mixture: the weight of {name!r} must be a number, got {value!r}") from None
    return weights


@dataclass
class Params(ObjectiveParams):
    """The mixture's own flag; each component takes its parameters from its own flags (``--group_size``,
    ``--mask_ratio_range``, ...), which ``ObjectiveArguments`` gathers into ``components``."""

    mixture: list[str] = flag(
        default_factory=list,
        help="--objective mixture: components and weights, e.g. 'dar=0.5 vmlm=0.5' (normalised); each component "
             "takes its parameters from the flags above (--group_size, --mask_ratio_range, ...)")
    # {name: plan params}: filled from the components' flags by ObjectiveArguments (not a flag itself)
    components: dict | None = flag(None, cli=False)

    def __post_init__(self):
        if not self.mixture:
            raise ValueError("--objective mixture needs its components and weights: --mixture NAME=WEIGHT ..., "
                             "e.g. --mixture dar=0.5 vmlm=0.5")
        self.plan_params()  # parses --mixture and checks every component's parameters

    def plan_params(self) -> dict:
        weights, components = check_mixture(parse_weights(self.mixture), self.components)
        return {"mixture": weights, "components": components}

    def collator_params(self) -> dict:
        return self.plan_params()


@dataclass
class MixtureCollator(PlanCollator):
    """A mixture of objectives (UL2's mixture of denoisers): each sequence gets the plan of one component objective,
    drawn from the weights ``mixture`` (``{name: weight}``, normalised), with ``components`` holding each
    component's plan parameters (``{"dar": {"t": [1, 2]}, "vmlm": {"mask_ratio_range": (0.15, 0.3)}}``).

    The plan is :func:`plan` (rows grouped by component, one plan call per component). What the
    single-objective collators add on top of their plan is kept per row: masked components never mask special
    tokens (``maskable`` goes to their rows). Two-stream only: the single-stream ``[MASK]`` form of the masked
    collators has no meaning for the rows of a look-ahead component."""

    mixture: dict | None = None
    components: dict | None = None
    objective = "mixture"

    def __post_init__(self):
        self.mixture, self.components = check_mixture(self.mixture, self.components)

    def uses_maskable(self) -> bool:
        from . import get  # the objectives table imports this module

        return any(get(name).takes_maskable for name in self.mixture)

    def plan_params(self):
        # checked once in __post_init__, not again for every batch
        return {"mixture": self.mixture, "components": self.components, "checked": True}


def target_ratio(params: dict) -> float:
    from . import max_target_ratio, mixture_components

    return max(max_target_ratio(name, component) for name, component in mixture_components(params).items())


OBJECTIVE = Objective(
    name="mixture",
    family=MIXTURE,
    title="mixture of objectives (UL2-style mixture of denoisers)",
    card_text="each sequence gets the plan of one component objective, drawn from normalised weights (seeded per "
              "batch); the components are trained together on one backbone.",
    Params=Params,
    plan=plan,
    collator=MixtureCollator,
    presets={"mix-dar12-vmlm": ("dar (t in {1, 2}) or vmlm U[0.15, 0.3], half each",
                                {"mixture": ["dar=0.5", "vmlm=0.5"], "group_size": [1, 2],
                                 "mask_ratio_range": [0.15, 0.3]})},
    target_ratio=target_ratio,
)
