"""``mixture``: a mixture of objectives (UL2's mixture of denoisers).

Each sequence gets the plan of one component objective, drawn from normalised weights (seeded per batch); the
components are trained together on one backbone. The plan parameters are ``{"mixture": {name: weight},
"components": {name: plan params}}``, and what the checkpoint was trained for (decoders, families, the loss
fraction) is that of its components.

Two forms:

- ``two_stream`` (default): every component's plan, trained on the query stream (``LookAroundForPreTraining``).
- ``single_stream`` (the one-stream mixture, ``--dar_form single_stream --masked_form single_stream``): dar's rows in
  SAT's one-stream form (block-causal, the row t places before a target predicts it) and the masked components'
  rows in BERT's ``[MASK]`` form (bidirectional), in one batch of width ``T + 2t - 2``, for ``LookAroundForCausalLM``
  with one LM head. Each row carries its kind (``row_kind``: 0 block-causal, 1 bidirectional), which selects its
  mask (``masking_lookaround.mixed_row_masks``). A masked row's text fills the first ``T`` slots, and its labels
  sit one slot after the masked token (the causal LM's loss shifts them back). The checkpoint loads with
  AutoModelForCausalLM (the dar half: ``generate(group_size=t)``) and AutoModelForMaskedLM (the masked half:
  bidirectional over ``[MASK]`` inputs); the two-stream pretraining head has nothing trained to read.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data.collators import PlanCollator
from ..models.lookaround.masking_lookaround import BIDIRECTIONAL_ROW, BLOCK_CAUSAL_ROW
from ..models.lookaround.masking_lookaround import one_stream_start_rows as start_rows
from ..plans import Plan, check_lengths
from .base import CAUSAL_HEAD, DEFAULT_MIXTURE, MASKED, MIXTURE, SINGLE_STREAM, TWO_STREAM, Objective, \
    ObjectiveParams, check_form, flag


def _table():
    from . import OBJECTIVES  # the table finds this module by name (and imports it then): read it on use

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


def check_one_stream_mixture(weights: dict, components: dict) -> int:
    """The group size of a one-stream mixture, or a ValueError that says what to fix: dar in its one-stream form
    (one group size >= 2) with masked components in BERT's form, nothing else."""
    one_stream = {"dar"} | {name for name, o in _table().items() if o.family == MASKED and o.elbo_plan is None}
    others = [name for name in weights if name not in one_stream]
    if others:
        raise ValueError(f"the one-stream mixture mixes dar's one-stream rows with the masked family's [MASK] rows; "
                         f"{others} have no such form: drop them or train the mixture two-stream")
    if "dar" not in weights or len(weights) < 2:
        raise ValueError("the one-stream mixture needs dar and at least one masked component (e.g. --mixture "
                         "dar=0.5 vmlm=0.5); a masked objective alone trains with --masked_form single_stream")
    t = components.get("dar", {}).get("t", _table()["dar"].defaults["t"])
    sizes = [t] if isinstance(t, int) else list(t)
    if len(sizes) != 1 or sizes[0] < 2:
        raise ValueError(f"the one-stream mixture takes one dar group size >= 2, got --group_size {sizes}: a masked "
                         "row's labels sit one slot after its text, in the start-row slots t = 1 does not have")
    return int(sizes[0])


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
    return plan_and_components(lengths, seq_len, mixture, components, num_condition_tokens, maskable, generator,
                               checked)[0]


def plan_and_components(lengths, seq_len: int, mixture=None, components=None, num_condition_tokens: int = 0,
                        maskable=None, generator=None, checked: bool = False) -> tuple[Plan, np.ndarray]:
    """:func:`plan`, and the (B,) index (into the weights' order) of the component each row drew."""
    weights, params = (mixture, components) if checked else check_mixture(mixture, components)
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    batch = lengths.numel()
    drawn = draw_mixture_components(batch, weights, generator).numpy()
    # rows are gathered and scattered in numpy: torch's index kernels run multi-threaded on the host and take
    # milliseconds when its cores are busy (compile workers, data loaders), numpy's microseconds
    group_ids = np.zeros((batch, seq_len), dtype=np.int64)
    is_target = np.zeros((batch, seq_len), dtype=bool)
    # the diffusion components' loss weights (normalised over their own rows); every other target weighs 1
    loss_weights = None
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
        if plan_.loss_weights is not None:
            if loss_weights is None:
                loss_weights = np.ones((batch, seq_len), dtype=np.float32)
            loss_weights[rows] = plan_.loss_weights.numpy()
    group_ids, is_target = torch.from_numpy(group_ids), torch.from_numpy(is_target)
    if loss_weights is not None:
        loss_weights = torch.from_numpy(np.where(is_target.numpy(), loss_weights, 0.0).astype(np.float32))
    return Plan(group_ids, is_target, loss_weights), drawn


def mixture_row_components(lengths, seq_len: int, mixture=None, components=None, generator=None) -> list[str]:
    """The component each row of :func:`mixture_plan` with this generator state gets (its first draw)."""
    weights, _ = check_mixture(mixture, components)
    names = list(weights)
    return [names[i] for i in draw_mixture_components(len(torch.as_tensor(lengths).flatten()), weights, generator)]


def merge_config_fields(fields: dict[str, dict]) -> dict:
    """The config fields of a mixture: those of its components (``{name: fields}``), merged. A list (the group
    sizes each trains) is the sorted union; any other value must be the same in every component that records it
    (a checkpoint records one diffusion block, one one-stream pattern), else a one-line ValueError."""
    merged, source = {}, {}
    for name, component in fields.items():
        for key, value in component.items():
            if isinstance(value, (list, tuple)):
                merged[key] = sorted(set(merged.get(key, [])) | set(value))
            elif key in merged and merged[key] != value:
                raise ValueError(f"mixture: its components record different {key} ({merged[key]!r} for "
                                 f"{source[key]!r}, {value!r} for {name!r}) and a checkpoint records one: drop one "
                                 f"of them from --mixture or give them the same value")
            else:
                merged[key], source[key] = value, name
    return merged


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
    # {name: collator params}, with each component's form (--dar_form, --masked_form): filled likewise
    component_collators: dict | None = flag(None, cli=False)
    # {name: the component's config_fields()} (what it records: group sizes, diffusion block, ...): filled likewise
    component_fields: dict | None = flag(None, cli=False)

    def __post_init__(self):
        if not self.mixture:
            raise ValueError("--objective mixture needs its components and weights: --mixture NAME=WEIGHT ..., "
                             "e.g. --mixture dar=0.5 vmlm=0.5")
        params = self.plan_params()  # parses --mixture and checks every component's parameters
        forms = {name: p.get("form", TWO_STREAM) for name, p in (self.component_collators or {}).items()}
        if len(set(forms.values())) > 1:
            raise ValueError(f"--objective mixture trains its components in one form, got {forms}: give "
                             "--dar_form single_stream --masked_form single_stream (the one-stream mixture) or neither")
        if self.form == SINGLE_STREAM:
            check_one_stream_mixture(params["mixture"], params["components"])
        self.config_fields()  # components that record different values are refused now, not at the model's config

    @property
    def form(self) -> str:
        forms = {p.get("form", TWO_STREAM) for p in (self.component_collators or {}).values()}
        return SINGLE_STREAM if forms == {SINGLE_STREAM} else TWO_STREAM

    def _group_size(self) -> int:
        params = self.plan_params()
        return check_one_stream_mixture(params["mixture"], params["components"])

    def plan_params(self) -> dict:
        weights, components = check_mixture(parse_weights(self.mixture), self.components)
        return {"mixture": weights, "components": components}

    def collator_params(self) -> dict:
        if self.form != SINGLE_STREAM:
            return self.plan_params()
        # BERT's replacement shares of the masked components (their flags are shared, so one value each)
        masked = next(p for p in self.component_collators.values() if "mask_replace_prob" in p)
        return {**self.plan_params(), "form": SINGLE_STREAM, "mask_replace_prob": masked["mask_replace_prob"],
                "random_replace_prob": masked["random_replace_prob"]}

    @classmethod
    def decoding_group_sizes(cls, plan_params: dict) -> tuple[int, ...]:
        """The union over its components of positive weight of the group sizes each trains."""
        from . import get  # the objectives table imports this module

        components = plan_params.get("components") or {}
        sizes = {t for name, weight in (plan_params.get("mixture") or {}).items() if float(weight) > 0
                 for t in get(name).Params.decoding_group_sizes(components.get(name) or {})}
        return tuple(sorted(sizes))

    def config_fields(self) -> dict:
        """What its components record, merged (:func:`merge_config_fields`): the union of their group sizes, a
        diffusion component's block (so the checkpoint decodes by diffusion), dar's one-stream pattern. The group
        sizes come from the plan parameters too, for a mixture given no ``component_fields``."""
        weights = self.plan_params()["mixture"]
        given = {name: f for name, f in (self.component_fields or {}).items() if weights.get(name, 0) > 0}
        return merge_config_fields({"mixture": super().config_fields(), **given})

    def input_width(self, block_size: int) -> int:
        return block_size + start_rows(self._group_size(), 1) if self.form == SINGLE_STREAM else block_size


@dataclass
class MixtureCollator(PlanCollator):
    """A mixture of objectives (UL2's mixture of denoisers): each sequence gets the plan of one component objective,
    drawn from the weights ``mixture`` (``{name: weight}``, normalised), with ``components`` holding each
    component's plan parameters (``{"dar": {"t": [1, 2]}, "vmlm": {"mask_ratio_range": (0.15, 0.3)}}``).

    The plan is :func:`plan` (rows grouped by component, one plan call per component). What the
    single-objective collators add on top of their plan is kept per row: masked components never mask special
    tokens (``maskable`` goes to their rows).

    ``form="single_stream"``: the one-stream mixture (module doc): ``input_ids`` and ``labels`` of width
    ``T + 2t - 2`` and ``row_kind`` (B,), for ``LookAroundForCausalLM`` with ``default_attention="block_causal"``.
    Its rows must all have one length (``pretrain`` packs blocks of ``--block_size``): a masked row reads every slot
    of its text, so padding would be read."""

    mixture: dict | None = None
    components: dict | None = None
    form: str = TWO_STREAM
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    group_size: int = field(default=0, init=False, repr=False)  # dar's t, in the one-stream form
    objective = "mixture"
    plan_function = staticmethod(plan)  # _draw calls plan_and_components: the plan and each row's component

    def __post_init__(self):
        self.mixture, self.components = check_mixture(self.mixture, self.components)
        check_form("form", self.form)
        if self.form == SINGLE_STREAM:
            from .mlm import check_replace_probs

            self.group_size = check_one_stream_mixture(self.mixture, self.components)
            check_replace_probs(self.mask_replace_prob, self.random_replace_prob)
            if getattr(self.tokenizer, "mask_token_id", None) is None:
                raise ValueError("the one-stream mixture feeds its masked rows [MASK] inputs, but the tokenizer has "
                                 "no mask token: use one with a mask token (e.g. --train_tokenizer) or the two-stream form")

    def uses_maskable(self) -> bool:
        from . import get  # the table finds this module by name: read it on use

        return any(get(name).takes_maskable for name in self.mixture)

    def plan_params(self):
        # checked once in __post_init__, not again for every batch
        return {"mixture": self.mixture, "components": self.components, "checked": True}

    def _draw(self, input_ids, lengths, generator):
        """The plan, and the component each row drew (the one-stream form lays rows out by their component)."""
        params = dict(self.plan_params())
        params["num_condition_tokens"] = self._condition_tokens(input_ids, lengths)
        if self.uses_maskable():
            params["maskable"] = self._maskable(input_ids, lengths)
        return plan_and_components(lengths, input_ids.shape[1], generator=generator, **params)

    def _finish(self, input_ids, attention_mask, drawn_plan, generator):
        plan_, drawn = drawn_plan
        if self.form == TWO_STREAM:
            return super()._finish(input_ids, attention_mask, plan_, generator)
        return self._one_stream(input_ids, attention_mask, plan_, drawn, generator)

    def _one_stream(self, input_ids, attention_mask, plan_, drawn, generator):
        """dar's rows in SAT's layout, the masked rows in BERT's form with their labels one slot later (module doc)."""
        from .dar import one_stream_layout
        from .mlm import bert_form

        t, bos, pad = self.group_size, getattr(self.tokenizer, "bos_token_id", None), self._pad_id()
        # (B, T) work in numpy, as in plans.py: torch's index and reduction kernels go multi-threaded, and a
        # collator in the main process then waits for busy cores
        ids, is_target = input_ids.numpy(), plan_.is_target.numpy()
        if not attention_mask.numpy().all():
            raise ValueError("the one-stream mixture takes rows of one length (a masked row reads every slot of its "
                             "text, padding included): pack blocks of equal length, as hf-lookaround pretrain does")
        if bos is None or (ids[:, 0] != bos).any():
            raise ValueError("the one-stream mixture needs every row to start with the BOS token (dar's start rows are "
                             "copies of it): pack blocks with BOS (hf-lookaround pretrain does)")
        batch, length = ids.shape
        width = length + start_rows(t, 1)
        is_dar = drawn == list(self.mixture).index("dar")
        inputs = np.full((batch, width), pad, dtype=np.int64)
        labels = np.full((batch, width), -100, dtype=np.int64)
        if is_dar.any():
            s1 = (plan_.group_ids.numpy()[is_dar] == 1).sum(1)  # the first text group (rank 1 after BOS)
            inputs[is_dar], labels[is_dar] = one_stream_layout(ids[is_dar], is_target[is_dar], s1, t, bos, pad)
        masked = ~is_dar
        if masked.any():
            bert_inputs, bert_labels = bert_form(ids[masked], is_target[masked], self.tokenizer,
                                                 self.mask_replace_prob, self.random_replace_prob, generator)
            inputs[masked, :length] = bert_inputs
            labels[masked, 1 : length + 1] = bert_labels  # row i predicts labels[i + 1] (the causal LM's shift)
        row_kind = np.where(is_dar, BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW)
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
                "row_kind": torch.from_numpy(row_kind)}


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
    single_stream_head=CAUSAL_HEAD,  # the one-stream mixture: one LM head, saved as a causal LM
    presets={"mix-dar12-vmlm": ("dar (t in {1, 2}) or vmlm U[0.15, 0.3], half each",
                                {"mixture": ["dar=0.5", "vmlm=0.5"], "group_size": [1, 2],
                                 "mask_ratio_range": [0.15, 0.3]})},
    target_ratio=target_ratio,
)
