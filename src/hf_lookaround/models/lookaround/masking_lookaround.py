"""Masks from plans: the one rule that says who may see whom, in the form each attention kernel takes.

A plan gives every row (content stream, then query stream) and every key a group rank; ``may_attend`` turns
ranks into attention. ``create_plan_mask`` builds the masks of one forward on the device, in the form the kernel
named by ``attn_implementation`` takes: ``PLAN_MASKS`` maps each kernel to the function that builds its mask (a
boolean mask for SDPA, an additive one for eager, a ``BlockMask`` for FlexAttention), as transformers'
``AttentionMaskInterface`` does for causal models; None is the plain causal fast path. A new kernel is one call:
``register_attention_kernel(name, attention_function, plan_mask)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.utils.generic import GeneralInterface

# A rank no real token has: padded target slots get it, so they see nothing.
NO_TARGET_RANK = -1


# ----------------------------------------------------------------------------------------------
# The mask rule. This is the only place that says who may see whom.
# ----------------------------------------------------------------------------------------------
def may_attend(query_rank, key_rank, query_is_strict, key_valid, key_is_noised=None):
    """True where a row of rank ``query_rank`` may attend to a content key of rank ``key_rank``.

    Content rows (``query_is_strict`` False) see ranks ``<=`` their own; query-stream rows
    (``query_is_strict`` True) see ranks ``<`` their target's. Invalid (padding) keys are never seen.
    Element-wise, so it serves broadcast tensors and FlexAttention's ``mask_mod`` alike.

    ``key_is_noised`` (BD3-LM's one-stream ``x_t ⊕ x_0`` layout, :func:`block_diffusion_plan`): the noised copy
    ``x_t`` of a block is a key too. Its rows are strict (they see the clean keys of earlier blocks only, as a
    query row does), and a noised key is seen by the noised rows of its own block alone (rank equal), never by a
    clean row: block-diagonal within ``x_t``, offset block-causal from ``x_t`` to ``x_0``, block-causal in ``x_0``.
    """
    seen = key_valid & ((key_rank < query_rank) | ((key_rank == query_rank) & ~query_is_strict))
    if key_is_noised is None:
        return seen
    return torch.where(key_is_noised, key_valid & query_is_strict & (key_rank == query_rank), seen)


def annealing_allows(row_position, key_position, key_revealed):
    """Attention-mask annealing (DiffuLLaMA, Gong et al. 2024): while a causal LM adapts to an objective, a row sees
    the keys up to its own position, and a later key only once that key is revealed. It is applied on top of
    :func:`may_attend` (never instead of it), so it only removes visibility the objective grants.
    Element-wise, as :func:`may_attend`."""
    return (key_position <= row_position) | key_revealed


def annealing_revealed_keys(progress: float, batch: int, num_keys: int, device=None,
                            generator: torch.Generator | None = None, copies: int = 1) -> torch.Tensor:
    """(B, K) bool: the keys revealed at annealing progress ``p`` (0: causal, 1: the objective's mask).

    Each key of each sequence draws a threshold ``u ~ U[0, 1)`` and is revealed to every earlier row iff ``u < p``,
    so a fraction ``p`` of the later keys is visible in expectation. DiffuLLaMA draws a Bernoulli(p) per (row, key)
    pair instead; a threshold per key keeps the mask's state (B, K), which a FlexAttention ``mask_mod`` reads as it
    reads the ranks, and has the same expected fraction.

    ``copies``: the keys hold the sequence ``copies`` times, one copy after another (BD3-LM's ``x_t ⊕ x_0``: 2);
    the copies of a token share its draw, as the two-stream form reveals a token's one key to every row."""
    if copies < 1 or num_keys % copies:
        raise ValueError(f"annealing: {num_keys} keys do not hold {copies} copies of a sequence")
    return (torch.rand(batch, num_keys // copies, device=device, generator=generator) < progress).repeat(1, copies)


def infilling_ranks(hidden: torch.Tensor, is_condition: torch.Tensor) -> torch.Tensor:
    """Ranks ``(B, T)`` of one step of infilling or of the masked-prefix protocol: the plan masked and GVP
    pretraining trained, for a set of visible tokens and the hidden positions to predict from them.

    As in the masked and GVP plans with ``num_condition_tokens``: the condition token (BOS, where
    ``is_condition``) has rank 0 and sees only itself; the visible tokens are the first group (rank 1, or 0 in a
    row without a condition token), bidirectional among themselves; the hidden positions are the next group
    (rank 2, or 1), whose query rows read the condition and the visible tokens. Padding gets any rank: its
    keys are invalid."""
    hidden, is_condition = torch.as_tensor(hidden, dtype=torch.bool), torch.as_tensor(is_condition, dtype=torch.bool)
    if hidden.shape != is_condition.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and is_condition {tuple(is_condition.shape)} must have one shape")
    if (hidden & is_condition).any():
        raise ValueError("a condition token (BOS) is visible by definition: it cannot be hidden")
    c = is_condition.any(-1, keepdim=True).long()
    return torch.where(is_condition, 0, torch.where(hidden, c + 1, c))


def one_stream_start_rows(group_size: int, first_group_size):
    """dar's one-stream form: the start rows (BOS copies) before a sequence whose first text group has
    ``first_group_size`` tokens. One block of ``t`` (the condition, whose rows predict the first group) and
    ``t - s1`` more that pad the first text group to a whole block, so that every group fills one block of ``t``
    slots and block-causal attention sees exactly the earlier groups. The collator lays out training batches
    and the decoder its prompts with it."""
    return 2 * group_size - 1 - first_group_size


# ``attn_implementation="lookaround_auto"``: SDPA with a boolean mask below this many keys, FlexAttention with a
# block-sparse BlockMask from it on. A dense mask costs every (row, key) pair; a BlockMask skips the blocks the plan
# leaves empty (about half of them for the AR family), which pays once attention dominates the step. The value
# comes from benchmarks/gpu_bench.py (docs/benchmarks.md, "Choosing the attention kernel"); set it from your own
# measurements if your card differs.
AUTO_ATTENTION = "lookaround_auto"
FLEX_ATTENTION_MIN_KEYS = 4096


def resolve_attention_implementation(implementation: str, key_len: int, device=None, built_once: bool = False) -> str:
    """The kernel a forward over ``key_len`` keys uses: ``lookaround_auto`` picks SDPA or FlexAttention by length.
    A mask ``built_once`` (the same for every batch of a shape) on CUDA is a BlockMask at any length: built once, a
    block-sparse mask beats SDPA's dense one."""
    if implementation != AUTO_ATTENTION:
        return implementation
    if key_len >= FLEX_ATTENTION_MIN_KEYS or (built_once and device is not None and torch.device(device).type == "cuda"):
        return "flex_attention"
    return "sdpa"


@dataclass
class AttentionPlan:
    """Who attends to whom in one forward: ranks of the rows (content then query stream) and of the keys."""

    query_rank: torch.Tensor  # (B, L) long, L = T content rows (+ M query rows)
    query_is_strict: torch.Tensor  # (B, L) bool: True on query-stream rows
    key_rank: torch.Tensor  # (B, K) long
    key_valid: torch.Tensor  # (B, K) bool
    key_is_noised: torch.Tensor | None = None  # (B, K) bool: BD3-LM's x_t keys (may_attend); None: no such keys
    # attention-mask annealing (:func:`annealing_allows`), all three or none: positions of rows and keys, and the
    # keys revealed to earlier rows
    row_position: torch.Tensor | None = None  # (B, L) long
    key_position: torch.Tensor | None = None  # (B, K) long
    key_revealed: torch.Tensor | None = None  # (B, K) bool

    @property
    def annealed(self) -> bool:
        return self.key_revealed is not None

    def rows(self, start: int) -> "AttentionPlan":
        """The same plan for rows ``start:`` only (e.g. the query stream, when the content stream's output is unread)."""
        row_position = None if self.row_position is None else self.row_position[:, start:]
        return dataclasses.replace(self, query_rank=self.query_rank[:, start:],
                                   query_is_strict=self.query_is_strict[:, start:], row_position=row_position)

    def annealed_as(self, other: "AttentionPlan") -> "AttentionPlan":
        """This plan with ``other``'s annealing (positions and revealed keys)."""
        return dataclasses.replace(self, row_position=other.row_position, key_position=other.key_position,
                                   key_revealed=other.key_revealed)

    def dense(self) -> torch.Tensor:
        """Boolean mask (B, 1, L, K), built on the device from the ranks."""
        noised = () if self.key_is_noised is None else (self.key_is_noised[:, None, :],)
        allowed = may_attend(
            self.query_rank[:, :, None],
            self.key_rank[:, None, :],
            self.query_is_strict[:, :, None],
            self.key_valid[:, None, :],
            *noised,
        )
        if self.annealed:
            allowed = allowed & annealing_allows(self.row_position[:, :, None], self.key_position[:, None, :],
                                                 self.key_revealed[:, None, :])
        return allowed[:, None]

    def row_sees_something(self) -> torch.Tensor:
        """(B, L) bool: a row sees at least one key iff it may attend to the lowest valid key rank."""
        if self.annealed or self.key_is_noised is not None:  # no single lowest key: ask the mask itself
            return self.dense()[:, 0].any(-1)
        big = torch.iinfo(self.key_rank.dtype).max
        lowest = torch.where(self.key_valid, self.key_rank, big).amin(-1, keepdim=True)
        return may_attend(self.query_rank, lowest, self.query_is_strict, self.key_valid.any(-1, keepdim=True))

    def block_mask(self):
        """A FlexAttention ``BlockMask`` from the same rule.

        ``create_block_mask`` evaluates ``may_attend`` on every (row, key) pair and keeps a block only if some pair
        in it may attend, so the BlockMask is exactly as sparse as the plan at block granularity: for the AR
        family the content and the query-stream rows are both block-causal (query rows follow their targets'
        order), and about half of the blocks are skipped. Build it once per batch, outside a compiled step
        (``LookAroundModel.prepare_attention``); every layer reuses it.
        """
        from torch.nn.attention.flex_attention import create_block_mask

        # int32 everywhere: inductor's CPU code generation fails on bool/int64 loads inside mask_mod
        q_rank, k_rank = self.query_rank.int(), self.key_rank.int()
        strict, k_valid = self.query_is_strict.int(), self.key_valid.int()
        k_noised = None if self.key_is_noised is None else self.key_is_noised.int()

        annealed = self.annealed
        if annealed:
            row_pos, key_pos, revealed = self.row_position.int(), self.key_position.int(), self.key_revealed.int()

        batch, rows = q_rank.shape
        # a plan of batch 1 serves every sequence of a batch (static_masks): the BlockMask broadcasts (B=None),
        # and its mask_mod, which the kernel calls with each sequence's index, reads row 0
        broadcast = batch == 1

        def mask_mod(b, h, q_idx, kv_idx):
            b = 0 if broadcast else b
            noised = () if k_noised is None else (k_noised[b, kv_idx] != 0,)
            allowed = may_attend(q_rank[b, q_idx], k_rank[b, kv_idx], strict[b, q_idx] != 0, k_valid[b, kv_idx] != 0,
                                 *noised)
            if annealed:
                allowed = allowed & annealing_allows(row_pos[b, q_idx], key_pos[b, kv_idx], revealed[b, kv_idx] != 0)
            return allowed

        # on the GPU a compiled builder evaluates the (rows x keys) grid without materialising it (long context)
        compile_builder = q_rank.is_cuda and not torch.compiler.is_compiling()
        return create_block_mask(mask_mod, None if broadcast else batch, None, rows, k_rank.shape[1],
                                 device=q_rank.device, _compile=compile_builder)


# ----------------------------------------------------------------------------------------------
# The mask of each attention kernel: one registry, keyed by ``attn_implementation``.
# ----------------------------------------------------------------------------------------------
def boolean_plan_mask(plan: AttentionPlan, sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, L, K) bool, True = attend (SDPA). Rows that see nothing (``sees`` False) see every key here: the caller
    zeroes them after the kernel."""
    return plan.dense() | ~sees[:, None, :, None]


def additive_plan_mask(plan: AttentionPlan, sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, L, K) in ``dtype``: 0 where a row attends, the dtype's minimum elsewhere (eager)."""
    allowed = boolean_plan_mask(plan, sees, dtype)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def block_plan_mask(plan: AttentionPlan, sees: torch.Tensor, dtype: torch.dtype):
    """A FlexAttention ``BlockMask`` (:meth:`AttentionPlan.block_mask`); rows that see nothing are zeroed after."""
    return plan.block_mask()


@dataclass(frozen=True)
class PlanMask:
    """How one attention kernel takes a plan's mask.

    build: ``(plan, sees, dtype) -> mask``, from the plan's ranks on the device (``sees``: (B, L) bool, the rows
        that see some key; the others must see every key inside the kernel, so that no softmax is empty).
    block_sparse: the mask is a FlexAttention ``BlockMask`` (a one-stream mixture batch then assembles it from its
        family masks instead of evaluating the grid).
    causal_without_mask: the kernel runs a plain causal forward (no padding, no cache offset) with no mask at all,
        through its own causal path (``is_causal``; SDPA may then pick its flash kernel).
    """

    build: Callable
    block_sparse: bool = False
    causal_without_mask: bool = False


def auto_plan_mask(plan: AttentionPlan, sees: torch.Tensor, dtype: torch.dtype):
    """``lookaround_auto``: the mask of the kernel it picks for this many keys."""
    kernel = resolve_attention_implementation(AUTO_ATTENTION, plan.key_rank.shape[1])
    return PLAN_MASKS[kernel].build(plan, sees, dtype)


class PlanMaskInterface(GeneralInterface):
    """``attn_implementation`` -> its :class:`PlanMask`: the one place that says which mask each kernel takes.
    Like transformers' ``AttentionMaskInterface``, a ``register`` is seen by every instance."""

    _global_mapping = {
        "eager": PlanMask(additive_plan_mask),
        "sdpa": PlanMask(boolean_plan_mask, causal_without_mask=True),
        "flex_attention": PlanMask(block_plan_mask, block_sparse=True),
        AUTO_ATTENTION: PlanMask(auto_plan_mask, causal_without_mask=True),
    }


PLAN_MASKS: PlanMaskInterface = PlanMaskInterface()


def plan_mask_of(implementation: str) -> PlanMask:
    """The registered mask of a kernel; an unknown one is a one-line error naming the registered kernels."""
    if implementation not in PLAN_MASKS:
        raise ValueError(
            f"attention kernel {implementation!r} has no plan mask; registered: {', '.join(sorted(PLAN_MASKS))}. "
            "Register it with register_attention_kernel(name, attention_function, plan_mask)"
        )
    return PLAN_MASKS[implementation]


def register_attention_kernel(name: str, attention_function: Callable, plan_mask: PlanMask | str) -> None:
    """Make ``attn_implementation=name`` work: ``attention_function`` joins transformers' ``AttentionInterface`` and
    ``plan_mask`` (a :class:`PlanMask`, or the name of a registered kernel whose mask it takes) the plan masks."""
    AttentionInterface.register(name, attention_function)
    PlanMaskInterface.register(name, plan_mask_of(plan_mask) if isinstance(plan_mask, str) else plan_mask)


def prepare_attention_mask(plan: AttentionPlan, implementation: str, dtype: torch.dtype):
    """The mask in the form the kernel takes, and the (B, L, 1, 1) factor that zeroes rows that see nothing.

    Rows that see nothing (a query row with no lower rank, a padded target slot) would give NaN in a
    softmax. They are let see every key inside the kernel, then multiplied by zero: no NaN, and
    exactly zero gradient to every key.
    """
    sees = plan.row_sees_something()
    kernel = resolve_attention_implementation(implementation, plan.key_rank.shape[1])
    return plan_mask_of(kernel).build(plan, sees, dtype), sees[:, :, None, None].to(dtype)


@dataclass
class PreparedAttention:
    """The masks of one batch in the backend's form, built once and reused by every layer.

    Build it with ``model.prepare_attention(**batch)`` before a compiled step and pass it as
    ``model(**batch, prepared_attention=...)``: the BlockMask is then never built inside the compiled graph.
    ``query_mask``/``query_row_factor`` cover the query-stream rows alone; the last layer uses them when nothing
    reads the content stream's output (``LookAroundForPreTraining`` with labels).
    """

    mask: object  # (B, 1, L, K) bool (sdpa), additive float (eager) or a BlockMask (flex)
    row_factor: torch.Tensor  # (B, L, 1, 1)
    num_content: int  # T: rows [0, T) are the content stream, [T, L) the query stream
    num_keys: int  # K
    query_mask: object | None = None
    query_row_factor: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.row_factor.shape[1]


def build_prepared_attention(plan: AttentionPlan, implementation: str, dtype: torch.dtype, num_content: int,
                             with_query_rows: bool) -> PreparedAttention:
    mask, row_factor = prepare_attention_mask(plan, implementation, dtype)
    prepared = PreparedAttention(mask, row_factor, num_content, plan.key_rank.shape[1])
    if with_query_rows:
        prepared.query_mask, prepared.query_row_factor = query_rows_of(prepared, plan, implementation, dtype)
    return prepared


def query_rows_of(prepared: PreparedAttention, plan: AttentionPlan, implementation: str, dtype: torch.dtype):
    """The query-stream rows' mask: a slice of a dense mask, a BlockMask of its own (built from the same rule)."""
    start = prepared.num_content
    if torch.is_tensor(prepared.mask):
        return prepared.mask[:, :, start:], prepared.row_factor[:, start:]
    return prepare_attention_mask(plan.rows(start), implementation, dtype)


def auto_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """``lookaround_auto``: the mask's form says the kernel (a BlockMask: FlexAttention; a tensor: SDPA)."""
    from torch.nn.attention.flex_attention import BlockMask

    kernel = "flex_attention" if isinstance(attention_mask, BlockMask) else "sdpa"
    return ALL_ATTENTION_FUNCTIONS[kernel](module, query, key, value, attention_mask, **kwargs)


def register_auto_attention() -> None:
    """Register ``lookaround_auto`` with transformers' attention functions (again is harmless). The models call it
    when a config asks for it (`_check_and_adjust_attn_implementation`), before transformers checks the name."""
    AttentionInterface.register(AUTO_ATTENTION, auto_attention_forward)


def check_prepared_attention(prepared: PreparedAttention, plan: AttentionPlan, num_content: int) -> None:
    want = (plan.query_rank.shape[1], plan.key_rank.shape[1], num_content)
    got = (prepared.num_rows, prepared.num_keys, prepared.num_content)
    if got != want:
        raise ValueError(
            f"prepared_attention was built for (rows, keys, content rows) = {got}, but this forward has {want}: "
            "build it with model.prepare_attention(**batch) from the same batch"
        )


def create_plan_mask(
    plan: AttentionPlan,
    implementation: str,
    dtype: torch.dtype,
    num_content: int,
    *,
    plain_causal: bool = False,
    query_rows_alone: bool = False,
    prepared: PreparedAttention | None = None,
    static_group_size: int | None = None,
    row_kind: torch.Tensor | None = None,
    static_pattern: str = "block_causal",
) -> PreparedAttention | None:
    """The masks of one forward, in the form ``implementation`` takes; None for the causal fast path.

    plain_causal: a single-stream causal forward with no padding and no cache offset; SDPA (and
        ``lookaround_auto``) then runs its own causal kernel without a mask (it may pick its flash kernel).
    query_rows_alone: the last layer runs the query rows alone (nothing reads the content stream's output);
        their own mask is built too.
    prepared: masks built beforehand by ``model.prepare_attention`` (outside a compiled step) for this batch.
    static_group_size: a block-causal (or, with ``static_pattern="block_diffusion"``, BD3-LM's one-stream) forward
        with no padding and no cache offset: its masks depend on the length alone, so they are built once per shape
        (:func:`static_masks`).
    row_kind: (B,) a one-stream mixture batch (with ``static_group_size``): each row block-causal or bidirectional
        (:func:`mixed_row_masks`).
    An annealed ``plan`` (attention-mask annealing, ``plan.key_revealed``) gets a mask of its own batch: the masks
    built once per shape (block-causal, one-stream mixture) serve again once annealing ends.
    """
    if prepared is not None:
        check_prepared_attention(prepared, plan, num_content)
        if query_rows_alone and prepared.query_mask is None:
            query_mask, query_row_factor = query_rows_of(prepared, plan, implementation, dtype)
            prepared = dataclasses.replace(prepared, query_mask=query_mask, query_row_factor=query_row_factor)
        return prepared
    if plain_causal and plan_mask_of(implementation).causal_without_mask:
        return None  # causal: annealing hides nothing
    if plan.annealed:  # annealing: this batch's own mask, not the masks built once per shape
        if row_kind is not None:
            check_row_kind(row_kind, row_kind.shape[0])
            plan = mixed_rows_plan(row_kind, static_group_size, num_content).annealed_as(plan)
        return build_prepared_attention(plan, implementation, dtype, num_content, with_query_rows=query_rows_alone)
    if row_kind is not None:
        return mixed_row_masks(row_kind, static_group_size, num_content, implementation, dtype)
    if static_group_size is not None:
        return static_masks(static_pattern, static_group_size, num_content, implementation, dtype,
                            plan.key_rank.device)
    return build_prepared_attention(plan, implementation, dtype, num_content, with_query_rows=query_rows_alone)


# (pattern, group size, length, kernel, dtype, device) -> the masks of an unpadded block-causal or block-diffusion forward
_STATIC_MASKS: dict[tuple, PreparedAttention] = {}


def block_causal_plan(group_size: int, length: int, device) -> AttentionPlan:
    """dar's one-stream form (batch 1): a row sees the keys of its own group of ``t`` and every earlier one."""
    rank = torch.div(torch.arange(length, device=device), group_size, rounding_mode="floor")[None]
    return AttentionPlan(query_rank=rank, query_is_strict=torch.zeros_like(rank, dtype=torch.bool),
                         key_rank=rank, key_valid=torch.ones_like(rank, dtype=torch.bool))


def block_diffusion_ranks(position, block_size: int):
    """BD3-LM's block rank of text position ``position`` (a row starts with BOS): the condition (position 0) rank 0,
    block ``k`` (positions ``1 + k b ..``) rank ``1 + 2k``: the clean ranks of the two-stream plan
    (``objectives/bd3lm.py``, whose masked tokens take ``2 + 2k``)."""
    return torch.where(position < 1, 0, 1 + 2 * torch.div(position - 1, block_size, rounding_mode="floor"))


def block_diffusion_layout(rank: torch.Tensor, key_valid: torch.Tensor) -> AttentionPlan:
    """BD3-LM's vectorised one-stream layout ``x_t ⊕ x_0`` (width ``2T``: the noised sequence, then the clean one;
    both copies of token ``i`` have position ``i``) from the clean block rank of each text position, ``rank``
    (B, T), and the valid keys ``key_valid`` (B, 2T). Every row and key takes its block's rank; the ``x_t`` rows are
    strict and the ``x_t`` keys noised, so :func:`may_attend` lets a noised block see itself and the clean blocks
    before it, and the clean half see itself block-causally."""
    ranks = torch.cat([rank, rank], 1)
    noised = torch.cat([torch.ones_like(rank, dtype=torch.bool), torch.zeros_like(rank, dtype=torch.bool)], 1)
    return AttentionPlan(query_rank=ranks, query_is_strict=noised, key_rank=ranks, key_valid=key_valid.bool(),
                         key_is_noised=noised)


def block_diffusion_plan(block_size: int, width: int, device, key_valid: torch.Tensor | None = None) -> AttentionPlan:
    """:func:`block_diffusion_layout` of rows that start with BOS, in blocks of ``block_size`` after it
    (:func:`block_diffusion_ranks`), ``width = 2T``; ``key_valid`` (B, 2T): padding (default: none, batch 1)."""
    if width % 2:
        raise ValueError(f"BD3-LM's one-stream layout x_t ⊕ x_0 has an even width (twice the sequence), got {width}")
    rank = block_diffusion_ranks(torch.arange(width // 2, device=device), block_size)[None]
    if key_valid is None:
        key_valid = torch.ones(1, width, dtype=torch.bool, device=device)
    return block_diffusion_layout(rank.expand(key_valid.shape[0], -1), key_valid)


STATIC_PLANS = {"block_causal": block_causal_plan, "block_diffusion": block_diffusion_plan}


def static_masks(pattern: str, group_size: int, length: int, implementation: str, dtype: torch.dtype,
                 device) -> PreparedAttention:
    """The masks of a forward over ``length`` rows without padding or cache whose pattern depends on the length alone
    (``STATIC_PLANS``: dar's block-causal one-stream form, BD3-LM's ``x_t ⊕ x_0``): the same for every batch, so they
    are built once per (pattern, group or block size, length, kernel, dtype, device), from :func:`may_attend`, with a
    batch dimension of 1 that broadcasts. A BlockMask costs milliseconds to build; a compiled step then reads the same
    mask every time (``model.prepare_attention``)."""
    kernel = resolve_attention_implementation(implementation, length, device, built_once=True)
    key = (pattern, group_size, length, kernel, dtype, str(device))
    # a cached mask outlives the call: built from normal tensors even under inference_mode (an evaluation), or a
    # later training forward of the same shape could not save it for backward
    if key not in _STATIC_MASKS:
        with torch.inference_mode(False):
            plan = STATIC_PLANS[pattern](group_size, length, device)
            _STATIC_MASKS[key] = build_prepared_attention(plan, kernel, dtype, length, with_query_rows=False)
    return _STATIC_MASKS[key]


# ----------------------------------------------------------------------------------------------
# The one-stream mixture: dar's one-stream rows (block-causal) and BERT's [MASK] rows (bidirectional) in one batch.
# ----------------------------------------------------------------------------------------------
# the kind of each row of a one-stream mixture batch (``row_kind``, (B,) int)
BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW = 0, 1


def mixed_row_rank(kind, index, group_size: int):
    """The rank of slot ``index`` in a row of ``kind``: its group's index in a block-causal row (dar's one-stream
    form), 0 everywhere in a bidirectional one (BERT's form). Element-wise, for dense masks and mask_mod alike."""
    return torch.where(kind == BLOCK_CAUSAL_ROW, torch.div(index, group_size, rounding_mode="floor"), 0)


def mixed_key_valid(kind, key_index, text_width: int):
    """A block-causal row may read every slot (what lies after a row's text is read only by rows that predict
    nothing); a bidirectional row reads its text, never the start-row slots the dar layout adds at the end."""
    return (kind == BLOCK_CAUSAL_ROW) | (key_index < text_width)


def mixed_text_width(group_size: int, width: int) -> int:
    """The text of a bidirectional row of a one-stream mixture batch: the block, without dar's start rows."""
    return width - one_stream_start_rows(group_size, 1)


def mixed_rows_plan(row_kind: torch.Tensor, group_size: int, width: int) -> AttentionPlan:
    """The attention plan of a one-stream mixture batch: each row's ranks from its kind (:func:`mixed_row_rank`)."""
    index = torch.arange(width, device=row_kind.device)[None, :]
    kind = row_kind[:, None]
    rank = mixed_row_rank(kind, index, group_size)
    return AttentionPlan(query_rank=rank, query_is_strict=torch.zeros_like(rank, dtype=torch.bool), key_rank=rank,
                         key_valid=mixed_key_valid(kind, index, mixed_text_width(group_size, width)))


def mixed_mask_mod(row_kind: torch.Tensor, group_size: int, width: int):
    """FlexAttention's ``mask_mod`` of a one-stream mixture batch: the row's kind, read from ``row_kind`` (int32:
    inductor's CPU code generation fails on bool/int64 loads inside mask_mod), selects its ranks; then
    :func:`may_attend`, the one rule."""
    text_width = mixed_text_width(group_size, width)

    def mask_mod(b, h, q_idx, kv_idx):
        kind = row_kind[b]
        q_rank, k_rank = mixed_row_rank(kind, q_idx, group_size), mixed_row_rank(kind, kv_idx, group_size)
        return may_attend(q_rank, k_rank, q_idx < 0, mixed_key_valid(kind, kv_idx, text_width))

    return mask_mod


# (group size, width, device) -> the BlockMask of each row kind (batch 1), in the order of the kinds
_FAMILY_BLOCK_MASKS: dict[tuple, tuple] = {}


def family_block_masks(group_size: int, width: int, device) -> tuple:
    """One BlockMask per row kind (batch 1): built once per shape, as :func:`static_masks` are."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (group_size, width, str(device))
    if key not in _FAMILY_BLOCK_MASKS:
        masks = []
        for kind in (BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW):
            row_kind = torch.full((1,), kind, dtype=torch.int32, device=device)
            compile_builder = torch.device(device).type == "cuda" and not torch.compiler.is_compiling()
            masks.append(create_block_mask(mixed_mask_mod(row_kind, group_size, width), 1, None, width, width,
                                           device=device, _compile=compile_builder))
        _FAMILY_BLOCK_MASKS[key] = tuple(masks)
    return _FAMILY_BLOCK_MASKS[key]


def mixed_block_mask(row_kind: torch.Tensor, group_size: int, width: int):
    """The BlockMask of a one-stream mixture batch, without ``create_block_mask``: each row takes the block tables of
    its kind's mask (built once, :func:`family_block_masks`) by a ``torch.where`` on the device, and the mask_mod
    reads the row's kind inside partial blocks. A few small tensor ops per batch instead of evaluating the
    (rows x keys) grid (~4 ms a batch on an H100, issue 33)."""
    from torch.nn.attention.flex_attention import BlockMask

    block_causal, bidirectional = family_block_masks(group_size, width, row_kind.device)
    is_block_causal = (row_kind == BLOCK_CAUSAL_ROW)[:, None, None]  # (B, 1, 1): broadcasts over heads, q blocks

    def pick(block_causal_table, bidirectional_table):
        extra = (None,) * (block_causal_table.dim() - 3)  # kv_indices have a kv-block dimension more
        return torch.where(is_block_causal[(...,) + extra], block_causal_table, bidirectional_table)

    return BlockMask.from_kv_blocks(
        pick(block_causal.kv_num_blocks, bidirectional.kv_num_blocks),
        pick(block_causal.kv_indices, bidirectional.kv_indices),
        pick(block_causal.full_kv_num_blocks, bidirectional.full_kv_num_blocks),
        pick(block_causal.full_kv_indices, bidirectional.full_kv_indices),
        BLOCK_SIZE=block_causal.BLOCK_SIZE,
        mask_mod=mixed_mask_mod(row_kind.int(), group_size, width),
        seq_lengths=(width, width),
    )


def check_row_kind(row_kind: torch.Tensor, batch: int) -> None:
    if row_kind.dim() != 1 or row_kind.shape[0] != batch:
        raise ValueError(f"row_kind must have shape ({batch},): one kind per row, got {tuple(row_kind.shape)}")
    if not torch.compiler.is_compiling() and not torch.isin(
            row_kind, torch.tensor([BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW], device=row_kind.device)).all():
        raise ValueError(f"row_kind holds {BLOCK_CAUSAL_ROW} (a block-causal row, dar's one-stream form) or "
                         f"{BIDIRECTIONAL_ROW} (a bidirectional row, BERT's [MASK] form), got {row_kind.tolist()}")


def mixed_row_masks(row_kind: torch.Tensor, group_size: int, width: int, implementation: str,
                    dtype: torch.dtype) -> PreparedAttention:
    """The masks of a one-stream mixture batch (no padding, no cache): a BlockMask assembled from the two family masks
    on the GPU (FlexAttention, and ``lookaround_auto`` on CUDA as for :func:`static_masks`), a dense mask from
    the same ranks otherwise (SDPA, eager)."""
    check_row_kind(row_kind, row_kind.shape[0])
    kernel = resolve_attention_implementation(implementation, width, row_kind.device, built_once=True)
    if plan_mask_of(kernel).block_sparse:
        row_factor = torch.ones(1, width, 1, 1, dtype=dtype, device=row_kind.device)  # every row sees a key
        return PreparedAttention(mixed_block_mask(row_kind, group_size, width), row_factor, width, width)
    return build_prepared_attention(mixed_rows_plan(row_kind, group_size, width), kernel, dtype, width,
                                    with_query_rows=False)


def cache_lengths(past_key_values: Cache | None, seq_len: int):
    """(tokens already cached, number of keys after appending `seq_len` more).

    A dynamic cache holds exactly past + current keys; a static cache always returns all its slots, and its past
    length is a 0-d tensor, so a compiled decoding step sees the same shapes and guards at every step."""
    if past_key_values is None:
        return 0, seq_len
    past_len = past_key_values.get_seq_length()
    key_len, _ = past_key_values.get_mask_sizes(seq_len, 0)
    return past_len, int(key_len)
