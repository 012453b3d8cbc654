"""What an objective is: a plan function, a parameters dataclass and a few facts, in one module of this folder.

Families, after the papers' concepts:

- ``look_ahead`` (AR, semi-AR): groups follow the text order, so the content stream is causal at group
  granularity; such checkpoints continue text with group decoding (``generate(group_size=t)``).
- ``masked`` ("look around", BERT/MAE, UL2's span corruption): one hidden group predicted from the visible
  rest; infilling, and a classic single-stream ``[MASK]`` form.
- ``any_order`` (GVP): groups follow a random order over positions; the condition group is bidirectional, so
  such checkpoints fill any set of positions (infilling).
- ``mixture`` (UL2's mixture of denoisers): each sequence gets the plan of one component objective, drawn from
  weights; the checkpoint has what each component family gives.
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar

LOOK_AHEAD, MASKED, ANY_ORDER, MIXTURE = "look_ahead", "masked", "any_order", "mixture"
FAMILIES = (LOOK_AHEAD, MASKED, ANY_ORDER, MIXTURE)  # also the order of the objectives table
# the decoders: group decoding (semi-AR) and any-order infilling
GROUP_DECODING, INFILLING = "group", "infill"
# the card templates of hub/cards.py (cards/*.md)
TEXT_CARD, MASKED_CARD = "text", "masked"  # card templates: hub/cards.py
# an objective's forms: the query stream predicts (every plan), or a classic single stream does (GPT, BERT, SAT)
TWO_STREAM, SINGLE_STREAM = "two_stream", "single_stream"
FORMS = (TWO_STREAM, SINGLE_STREAM)
# the heads a single-stream form trains
CAUSAL_HEAD, MASKED_HEAD = "causal", "masked"
# the mixture drawn when none is given: semi-AR (t = 2) and variable-length masking, half each; here, below both the
# table and mixture.py, so that neither imports the other to read it
DEFAULT_MIXTURE = {"dar": 0.5, "vmlm": 0.5}


def flag(default=None, help: str = "", default_factory=None, **metadata):
    """A parameter of an objective: its field name is its command-line flag (``--name``), ``help`` its help."""
    metadata = {"help": help, **metadata}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def check_form(name: str, value: str, allowed=FORMS) -> None:
    if value not in allowed:
        raise ValueError(f"--{name} must be one of {allowed}, got {value!r}")


@dataclass
class ObjectiveParams:
    """The base of an objective's parameters. Subclasses are dataclasses whose fields are the objective's flags
    (defaults, help in the field's metadata); ``__post_init__`` validates them with messages that name the flag.

    ``SPEC``: the short forms ``hf-lookaround theory`` takes for the objective (``dar:T``, ``mlm:RHO``), read by
    :meth:`from_spec`; None: the objective has none."""

    SPEC: ClassVar[str | None] = None

    @classmethod
    def from_spec(cls, arg: str) -> "ObjectiveParams":
        """The parameters a spec's argument (the text after ``name:``, empty when absent) writes; a ValueError
        when it is not one of the forms of ``SPEC``."""
        raise ValueError(f"{cls.__module__} takes no spec")

    def plan_params(self) -> dict:
        """The keyword arguments of the plan function (recorded in ``config.plan_params``)."""
        return {}

    def collator_params(self) -> dict:
        """The keyword arguments of the objective's collator."""
        return self.plan_params()

    @property
    def form(self) -> str:
        return TWO_STREAM

    def check_block_size(self, block_size: int) -> None:
        """Refuse a block too short for the plan (a ValueError that names the flags to change)."""

    @classmethod
    def decoding_group_sizes(cls, plan_params: dict) -> tuple[int, ...]:
        """The group sizes ``t`` a plan with these parameters trains, so those ``generate(group_size=t)`` decodes a
        checkpoint with: ``()`` for none (masked and any-order plans). A look-ahead objective overrides it."""
        return ()

    def config_fields(self) -> dict:
        """Fields of the model config this objective sets: what a checkpoint can decode (``decoding_group_sizes``,
        read by the model bundle's decoders) and what its form needs (dar's one-stream form: its block-causal
        pattern). A subclass adds its own to ``super().config_fields()``."""
        return {"decoding_group_sizes": list(self.decoding_group_sizes(self.plan_params()))}

    def input_width(self, block_size: int) -> int:
        """The model's input width for blocks of ``block_size`` tokens (a form may add start rows)."""
        return block_size


@dataclass(frozen=True)
class Objective:
    """One pretraining objective: every consumer (collators, CLI, decoders, cards, demo, study) reads these."""

    name: str
    family: str
    title: str  # the objective's name on a model card
    card_text: str  # its plan in words, for the card
    Params: type  # an ObjectiveParams dataclass: defaults, validation, help; its fields are the CLI flags
    plan: Callable  # f(lengths, seq_len, **plan params, num_condition_tokens=0, generator=None) -> plans.Plan
    collator: type  # the PlanCollator subclass that pads a batch and draws the plan
    # named settings, rows of the demo and the study: {row name: (description, {flag: value})}
    presets: dict = field(default_factory=dict)
    image_defaults: dict | None = None  # plan parameters for images (None: not an image objective)
    # an upper bound on the fraction of a sequence that carries a loss, from the plan parameters (None: all of it)
    target_ratio: Callable[[dict], float] | None = None
    # the least fraction of a sequence its top rank holds (None: no useful bound, e.g. GVP's last group): the
    # content rows dropped with --drop_unread_content, so a compiled step can keep one width for every batch
    min_top_ratio: Callable[[dict], float] | None = None
    single_stream_head: str | None = None  # the head its single-stream form trains (None: no such form)
    # the top rank holds many tokens whose content rows nothing reads: pretrain drops them by default
    drops_unread_content: bool = False
    # every plan of one sequence with its probability, for the theory module's exact co-occurrence matrices:
    # f(n, num_condition_tokens, **plan params) -> [(probability, group_ids (n,), is_target (n,))], every position
    # after the prefix maskable (None: no exact enumeration; the plans are sampled)
    exact_plans: Callable | None = None
    # a diffusion objective (mdlm, bd3lm): its loss is the negative ELBO, and this draws one Monte-Carlo sample of
    # it, f(lengths, seq_len, **plan params, num_condition_tokens, generator) -> Plan whose loss_weights give each
    # row's negative ELBO per token as sum(weight * cross-entropy) (perplexity --protocol elbo); None: not one
    elbo_plan: Callable | None = None

    @property
    def defaults(self) -> dict:
        """The plan parameters the plan function uses when none are given (text)."""
        ignored = {"lengths", "seq_len", "generator", "maskable", "num_condition_tokens", "checked"}
        return {
            name: p.default for name, p in inspect.signature(self.plan).parameters.items()
            if name not in ignored and p.default is not inspect.Parameter.empty
        }

    @functools.cached_property
    def takes_maskable(self) -> bool:
        """Whether its plan takes ``maskable`` (positions that may be masked: special tokens never are)."""
        return "maskable" in inspect.signature(self.plan).parameters

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.Params))

    @property
    def decoders(self) -> tuple[str, ...]:
        if self.family == MIXTURE:
            return ()  # those of its components: see objectives.decoders(name, params)
        return (GROUP_DECODING,) if self.family == LOOK_AHEAD else (INFILLING,)

    @property
    def card_template(self) -> str:
        return MASKED_CARD if self.family == MASKED else TEXT_CARD

    @property
    def default_attention(self) -> str:
        """The single-stream pattern a checkpoint of this objective uses without a plan (config.default_attention)."""
        return "causal" if self.family == LOOK_AHEAD else "bidirectional"
