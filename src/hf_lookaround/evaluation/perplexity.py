"""Perplexity of autoregressive and masked models on held-out text: ``hf-lookaround perplexity``.

Two protocols, both scoring ``p(x_k | x_<k)`` (DESIGN.md, "Evaluation protocols"):

- ``ar``: any causal LM (``LookAroundForCausalLM`` or any ``AutoModelForCausalLM``), one forward per
  window; the logits at ``k - 1`` predict ``x_k``. A two-stream checkpoint (``LookAroundForPreTraining``)
  is scored through its query stream with the AR plan instead: that is the pathway pretraining trained.
- ``masked``: the prefix is visible, position ``k`` is masked, nothing after ``k`` is visible
  (paper (a) Table 7 and Fig. 3). Three ways to run it (``masked_mode``):
    * ``mask_token``: a single-stream ``[MASK]`` model (``AutoModelForMaskedLM``): the input is
      ``x_<k`` followed by ``[MASK]``, truncated after ``k``, bidirectional attention; batched over ``k``.
    * ``two_stream``: ``LookAroundForPreTraining`` with the AR plan (``g = arange``): the query stream
      at ``k`` sees exactly the content at ranks ``< k``, so one forward scores every ``k``. The content
      stream of the prefix is causal, as in AR / semi-AR pretraining.
    * ``two_stream_prefix``: the two-stream model with the plan masked pretraining trained: BOS alone at
      rank 0, the prefix as one group (bidirectional among itself, rank 1) and ``k`` as the next (rank 2); in a
      window without BOS the prefix has rank 0 and ``k`` rank 1. The exact two-stream analogue of
      ``mask_token``; batched over ``k``.

Long text is scored in sliding windows, the way the transformers docs compute perplexity of
fixed-length models: windows of ``max_length`` tokens, moved by ``stride``; only the new tokens of a
window are scored, with the earlier tokens of the window as their context (at least
``max_length - stride`` tokens of context once the window is full). Every token but the first of a
document is scored exactly once; with a BOS token prepended (the default when the tokenizer has one)
the first is scored too.

Figures: perplexity per token ``exp(mean NLL)`` and bits per UTF-8 byte of the scored text
(``total NLL / ln 2 / bytes``), which compares models with different tokenizers. The masked protocol
is also reported against the prefix length (number of text tokens visible before ``k``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import objectives
from ..decoding import is_block_diffusion_model, is_one_stream_group_model
from ..models.lookaround.masking_lookaround import block_diffusion_layout, build_prepared_attention, infilling_ranks
from ..objectives.bd3lm import one_stream_layout

logger = logging.getLogger(__name__)

__all__ = [
    "PROTOCOLS",
    "MASKED_MODES",
    "PerplexityResult",
    "Window",
    "encode_documents",
    "sliding_windows",
    "ar_perplexity",
    "masked_perplexity",
    "elbo_perplexity",
    "elbo_objective",
    "full_length_masked_nlls",
    "default_masked_mode",
    "is_two_stream",
    "bucket_by_prefix_length",
    "plot_by_prefix_length",
]

PROTOCOLS = ("ar", "masked", "elbo")  # elbo: diffusion checkpoints (elbo_perplexity, below)
MASKED_MODES = ("mask_token", "two_stream", "two_stream_prefix")


@dataclass
class Window:
    """A window of one document: ``input_ids`` and the first index whose token is scored.

    ``offset`` is the number of leading special tokens (BOS) in the window; prefix lengths count
    text tokens only."""

    input_ids: list[int]
    first_scored: int
    offset: int = 0

    def prefix_lengths(self) -> np.ndarray:
        return np.arange(self.first_scored, len(self.input_ids)) - self.offset


@dataclass
class PerplexityResult:
    """Per-token NLLs (nats) with their prefix lengths, and the UTF-8 bytes of the scored text."""

    protocol: str
    nlls: np.ndarray
    prefix_lengths: np.ndarray
    num_bytes: int
    extra: dict = field(default_factory=dict)
    # tokens the bytes hold when only a sample of them was scored (``positions_per_window``); None: all were
    num_scorable_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.nlls.size)

    @property
    def mean_nll(self) -> float:
        return float(self.nlls.mean())

    @property
    def perplexity(self) -> float:
        return float(math.exp(self.mean_nll))

    @property
    def bits_per_byte(self) -> float:
        # a sample of the tokens stands for all of them: its mean NLL times the number of tokens
        total = self.nlls.sum() if self.num_scorable_tokens is None else self.nlls.mean() * self.num_scorable_tokens
        return float(total / math.log(2) / self.num_bytes)

    def to_dict(self, dataset: str | None = None, buckets=None) -> dict:
        key = "ar_perplexity" if self.protocol == "ar" else "masked_perplexity"
        return {
            "dataset": dataset,
            "protocol": self.protocol,
            key: self.perplexity,
            "bits_per_byte": self.bits_per_byte,
            "num_tokens": self.num_tokens,
            "num_bytes": int(self.num_bytes),
            "nll_per_token": self.mean_nll,
            **self.extra,
            "by_prefix_length": bucket_by_prefix_length(self.nlls, self.prefix_lengths, buckets),
        }


# ---------------------------------------------------------------------------------------------
# text -> windows
# ---------------------------------------------------------------------------------------------


def _bos_id(tokenizer) -> int | None:
    for name in ("bos_token_id", "cls_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return value
    return None


def encode_documents(tokenizer, texts: list[str], add_bos: bool | None = None):
    """Token ids of each document (BOS/CLS prepended if ``add_bos``; default: if the tokenizer has
    one) and the UTF-8 byte count of the text that will be scored."""
    bos = _bos_id(tokenizer) if add_bos in (None, True) else None
    if add_bos and bos is None:
        raise ValueError("add_bos=True but the tokenizer has neither a bos_token nor a cls_token")
    fast = getattr(tokenizer, "is_fast", False)
    docs, num_bytes = [], 0
    for text in texts:
        # verbose=False: a document longer than model_max_length is expected here (windows cut it)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast, verbose=False)
        ids = list(enc["input_ids"])
        if not ids:
            continue
        if bos is not None:
            docs.append([bos] + ids)
            num_bytes += len(text.encode("utf-8"))
        elif len(ids) > 1:
            # without BOS the first token has no context and is not scored: count bytes from the second
            docs.append(ids)
            if fast:
                num_bytes += len(text[enc["offset_mapping"][1][0] :].encode("utf-8"))
            else:
                num_bytes += len(tokenizer.decode(ids[1:]).encode("utf-8"))
    if not docs:
        raise ValueError("no document has a token to score (each needs a BOS token or at least two tokens)")
    return docs, num_bytes, bos is not None


def sliding_windows(ids: list[int], max_length: int, stride: int, has_bos: bool = False) -> list[Window]:
    """Windows of at most ``max_length`` tokens that together score tokens ``1..n-1`` once each.

    The first window scores everything it holds; each later one ends ``stride`` tokens further and
    scores only its last ``stride`` tokens, with the ``max_length - stride`` tokens before them as context.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if not 1 <= stride < max_length:
        raise ValueError(
            f"stride must lie in [1, max_length - 1] = [1, {max_length - 1}], got {stride}: "
            "every scored token needs at least one token of context in its window"
        )
    n = len(ids)
    windows, start = [], 1
    while start < n:
        end = min(n, max_length if start == 1 else start + stride)
        begin = max(0, end - max_length)
        offset = 1 if (has_bos and begin == 0) else 0
        windows.append(Window(ids[begin:end], start - begin, offset))
        start = end
    return windows


def _pad(rows: list[list[int]], pad_id: int):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _scored(logits: torch.Tensor, targets: torch.Tensor, greedy: list | None = None) -> torch.Tensor:
    """``_nll`` on the host; with ``greedy`` (a list), also appends whether each target is the argmax (lm-eval's
    ``is_greedy``)."""
    if greedy is not None:
        greedy.append((logits.argmax(-1) == targets).cpu())
    return _nll(logits, targets).cpu()


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _pad_id(model, tokenizer) -> int:
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(model.config, "pad_token_id", None)):
        if value is not None:
            return value
    return 0


def window_limit(config) -> int:
    """The longest window a checkpoint scores: its positions (dar's one-stream form: less its start rows, which
    its config's ``n_positions`` leaves out)."""
    max_positions = getattr(config, "max_position_embeddings", None) or 512
    return config.n_positions if is_one_stream_group_model(config) else max_positions


def default_max_length(config) -> int:
    """The default window: the length the checkpoint was trained on (``config.trained_block_size``), else up to
    512 tokens, within :func:`window_limit`."""
    return min(getattr(config, "trained_block_size", None) or 512, window_limit(config))


def _windows_of(docs, max_length, stride, has_bos):
    return [w for doc in docs for w in sliding_windows(doc, max_length, stride, has_bos)]


# ---------------------------------------------------------------------------------------------
# protocols
# ---------------------------------------------------------------------------------------------


def is_two_stream(model) -> bool:
    """A LookAround pretraining head: predictions come from the query stream of a plan."""
    # by name, so that remote-code classes and FSDP2's `FSDPLookAroundForPreTraining` subclass count too
    return any(cls.__name__ == "LookAroundForPreTraining" for cls in type(model).__mro__)


@torch.inference_mode()
def ar_perplexity(model, tokenizer, texts, max_length=512, stride=256, batch_size=8, add_bos=None) -> PerplexityResult:
    """Autoregressive perplexity ``p(x_k | x_<k)``.

    A causal LM (any ``AutoModelForCausalLM``) predicts ``x_k`` from its state at ``k - 1``. A two-stream
    ``LookAroundForPreTraining`` predicts it from the query stream at ``k`` under the AR plan (DESIGN.md:
    "one forward with the AR plan"); its single-stream causal view was never trained to predict the next token.
    dar's one-stream form (a block-causal ``LookAroundForCausalLM``) predicts ``x_k`` from the row ``t`` slots
    before it, which has seen all of ``x_<k`` when ``x_k`` opens a group: the causal LM's next-token view (``t``
    layouts of each window, one per first-group size, in one batched forward) scores every token once
    (:func:`_one_stream_ar`).
    """
    docs, num_bytes, has_bos = encode_documents(tokenizer, texts, add_bos)
    windows = _windows_of(docs, max_length, stride, has_bos)
    nlls, mode = ar_window_nlls(model, windows, batch_size, _pad_id(model, tokenizer), _bos_id(tokenizer))
    result = _result("ar", nlls, [w.prefix_lengths() for w in windows], num_bytes, max_length, stride)
    if mode != "causal_lm":
        result.extra["ar_mode"] = mode
    return result


def ar_window_nlls(model, windows: list[Window], batch_size: int, pad: int, bos: int | None,
                   greedy: list | None = None) -> tuple[list[torch.Tensor], str]:
    """The NLLs of each window's scored tokens by the checkpoint's exact AR path, and that path's name (``ar_mode``):
    dar's one-stream form (``one_stream_groups``), a two-stream head under the AR plan (``two_stream``), else a
    causal LM (``causal_lm``). ``greedy`` (a list): also gets, per window, whether each token is the argmax."""
    if is_one_stream_group_model(model.config):
        return _one_stream_ar(model, windows, batch_size, pad, bos, greedy), "one_stream_groups"
    if is_two_stream(model):
        return _two_stream_ar_plan(model, windows, batch_size, pad, greedy), "two_stream"
    return _causal_lm(model, windows, batch_size, pad, greedy), "causal_lm"


def _causal_lm(model, windows, batch_size, pad, greedy=None) -> list[torch.Tensor]:
    device, nlls = _device(model), []
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        ids, mask = _pad([w.input_ids for w in batch], pad)
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for b, w in enumerate(batch):
            n = len(w.input_ids)
            # logits at k - 1 predict token k
            nlls.append(_scored(logits[b, w.first_scored - 1 : n - 1], ids[b, w.first_scored : n].to(device), greedy))
    return nlls


def _reads_a_trained_masked_half(model) -> bool:
    """A masked LM on a one-stream mixture with a masked component: its rows of that component trained the
    bidirectional content stream over ``[MASK]`` inputs, which the masked LM reads (dar's rows are block-causal)."""
    config = model.config
    trained = objectives.families(getattr(config, "objective", None), getattr(config, "plan_params", None)) or ()
    return objectives.MASKED in trained and type(model).__name__.endswith("ForMaskedLM")


@torch.inference_mode()
def masked_perplexity(
    model, tokenizer, texts, max_length=512, stride=256, batch_size=8, add_bos=None, mode="auto",
    positions_per_window: int | None = None, progress: bool = True,
) -> PerplexityResult:
    """Masked-model perplexity ``p(x_k | x_<k)``: prefix visible, ``k`` masked, nothing after ``k``.

    ``mode="auto"`` picks :func:`default_masked_mode` of the model. The per-prefix modes (``mask_token``,
    ``two_stream_prefix``) run one row per scored position, ``max_length`` times the work of one forward per
    window: ``positions_per_window=m`` scores only ``m`` evenly spaced prefix lengths of each window (every
    prefix-length bucket keeps tokens; bits per byte extrapolate the sample's mean NLL to all tokens).
    ``progress``: a tqdm bar over the windows."""
    if is_one_stream_group_model(model.config) and not _reads_a_trained_masked_half(model):
        raise ValueError("this checkpoint is dar's one-stream form (block-causal): it has no bidirectional prefix to "
                         "mask; score it with the ar protocol (ar_perplexity, CLI: --protocol ar), which gives the "
                         "same p(x_k | x_<k)")
    if mode == "auto":
        mode = default_masked_mode(model)
    if mode not in MASKED_MODES:
        raise ValueError(f"masked mode must be one of {MASKED_MODES} or 'auto', got {mode!r}")
    if mode.startswith("two_stream") and not is_two_stream(model):
        raise ValueError(f"masked mode {mode!r} needs a LookAroundForPreTraining model, got {type(model).__name__}")
    docs, num_bytes, has_bos = encode_documents(tokenizer, texts, add_bos)
    windows = _windows_of(docs, max_length, stride, has_bos)
    pad = _pad_id(model, tokenizer)
    if mode == "two_stream":
        nlls = _two_stream_ar_plan(model, windows, batch_size, pad)
    else:
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mode == "mask_token" and mask_id is None:
            mask_id = getattr(model.config, "mask_token_id", None)
        if mode == "mask_token" and mask_id is None:
            raise ValueError("the mask_token protocol needs a mask token: the tokenizer and config have none")
        if positions_per_window is not None and positions_per_window < 1:
            raise ValueError(f"positions_per_window must be >= 1 (or None: every position), got {positions_per_window}")
        chosen = [_positions(w, positions_per_window) for w in windows]
        nlls = _per_prefix(model, windows, batch_size, pad, mask_id, two_stream=(mode == "two_stream_prefix"),
                           chosen=chosen, progress=progress)
        scorable = sum(len(w.input_ids) - w.first_scored for w in windows)
        prefixes = [np.asarray(ks) - w.offset for w, ks in zip(windows, chosen)]
        result = _result("masked", nlls, prefixes, num_bytes, max_length, stride)
        if result.num_tokens < scorable:
            result.num_scorable_tokens = scorable
            result.extra["positions_per_window"] = positions_per_window
            result.extra["num_scorable_tokens"] = scorable
        result.extra["masked_mode"] = mode
        return result
    result = _result("masked", nlls, [w.prefix_lengths() for w in windows], num_bytes, max_length, stride)
    result.extra["masked_mode"] = mode
    return result


@torch.inference_mode()
def full_length_masked_nlls(model, tokenizer, texts, max_length=512, stride=256, batch_size=8, add_bos=None):
    """The masked protocol with full-length inputs, for a two-stream ``LookAroundForPreTraining``: each row is the
    whole window, the positions ``>= k`` hidden (the target's group, ``infilling_ranks``), scored at ``k``. The
    learning-curves study's ``full_length`` measure; the same ``p(x_k | x_<k)`` as
    ``two_stream_prefix``, whose rows end at ``k``. Returns ``(nlls, prefix lengths)`` (numpy) in text order."""
    if not is_two_stream(model):
        raise ValueError(f"the full-length masked protocol needs a LookAroundForPreTraining model, got "
                         f"{type(model).__name__}")
    docs, _, has_bos = encode_documents(tokenizer, texts, add_bos)
    windows = _windows_of(docs, max_length, stride, has_bos)
    pad, device = _pad_id(model, tokenizer), _device(model)
    nlls, prefixes = [], []
    for w in windows:
        ks = list(range(w.first_scored, len(w.input_ids)))
        for i in range(0, len(ks), batch_size):
            chunk = torch.tensor(ks[i : i + batch_size])
            ids, mask = _pad([w.input_ids] * len(chunk), pad)
            hidden = torch.arange(ids.shape[1])[None, :] >= chunk[:, None]
            is_condition = torch.zeros_like(hidden)
            is_condition[:, 0] = bool(w.offset)  # the window starts with the document's BOS
            group_ids = infilling_ranks(hidden, is_condition)
            logits = _two_stream_logits(model, ids, mask, group_ids, chunk[:, None], device)[:, 0]
            gold = ids[torch.arange(len(chunk)), chunk].to(device)
            nlls.append(_nll(logits, gold).cpu().double().numpy())
        prefixes.append(np.asarray(ks) - w.offset)
    return np.concatenate(nlls), np.concatenate(prefixes)


def _positions(window: Window, per_window: int | None) -> list[int]:
    """The scored positions of ``window``: all, or ``per_window`` of them evenly spaced (first and last kept)."""
    ks = np.arange(window.first_scored, len(window.input_ids))
    if per_window is None or per_window >= len(ks):
        return ks.tolist()
    return sorted(set(np.linspace(ks[0], ks[-1], per_window).round().astype(int).tolist()))


def default_masked_mode(model) -> str:
    """``mask_token`` for single-stream masked LMs. For two-stream models, the AR plan (one forward) when the
    checkpoint was pretrained with a (semi-)autoregressive plan, whose content stream is causal; otherwise
    (masked, GVP) ``two_stream_prefix``, whose rank-0 prefix is bidirectional as in masked pretraining."""
    if not is_two_stream(model):
        return "mask_token"
    objective = getattr(model.config, "objective", None)
    # a mixture with a look-ahead component was trained on the AR-like plans too: the AR plan, as natural
    trained = objectives.families(objective, getattr(model.config, "plan_params", None))
    look_ahead = objective is None or objectives.LOOK_AHEAD in trained
    return "two_stream" if look_ahead else "two_stream_prefix"


def _two_stream_ar_plan(model, windows, batch_size, pad, greedy=None) -> list[torch.Tensor]:
    """One forward per window: AR plan ranks, query stream at every scored position."""
    from hf_lookaround.objectives.ar import plan as autoregressive_plan

    device, out = _device(model), []
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        ids, mask = _pad([w.input_ids for w in batch], pad)
        group_ids = autoregressive_plan(mask.sum(-1), ids.shape[1]).group_ids
        width = max(len(w.input_ids) - w.first_scored for w in batch)
        targets = torch.full((len(batch), width), -1, dtype=torch.long)
        for b, w in enumerate(batch):
            targets[b, : len(w.input_ids) - w.first_scored] = torch.arange(w.first_scored, len(w.input_ids))
        logits = _two_stream_logits(model, ids, mask, group_ids, targets, device)
        for b, w in enumerate(batch):
            m = len(w.input_ids) - w.first_scored
            out.append(_scored(logits[b, :m], ids[b, w.first_scored :][:m].to(device), greedy))
    return out


def _one_stream_ar(model, windows, batch_size, pad, bos, greedy=None) -> list[torch.Tensor]:
    """``p(x_k | x_<k)`` from dar's one-stream form, through the causal LM's next-token view (its forward on plain
    token ids lays each row out once per first-group size ``s1`` and reads each token from the row that has seen
    every earlier token: ``t`` forwards' worth, batched). A window that does not start with BOS (a later window of
    a long document) gets one in front, as every training row had; the last token is only a target and is not fed,
    so that such a window of ``config.n_positions`` tokens still fits the causal view."""
    if bos is None:
        raise ValueError("dar's one-stream form lays out every row after BOS copies: the tokenizer has no BOS token")
    device, out = _device(model), []
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        rows = [w.input_ids if w.offset else [bos, *w.input_ids] for w in batch]
        ids, mask = _pad([r[:-1] for r in rows], pad)
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # logits[:, k - 1]: x_k
        for b, w in enumerate(batch):
            first = w.first_scored + (0 if w.offset else 1)
            targets = torch.tensor(rows[b][first:], device=device)
            out.append(_scored(logits[b, first - 1 : len(rows[b]) - 1], targets, greedy))
    return out


def _two_stream_logits(model, ids, mask, group_ids, targets, device):
    return model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        group_ids=group_ids.to(device),
        target_positions=targets.to(device),
    ).logits


def _per_prefix(model, windows, batch_size, pad, mask_id, two_stream: bool, chosen=None,
                progress: bool = False, greedy: list | None = None) -> list[torch.Tensor]:
    """One row per scored position ``k`` (``chosen[i]``: those of window ``i``; default all): ``x_<k`` then the
    target slot, truncated after ``k``. Rows of one window have close lengths: batching them wastes little."""
    from tqdm.auto import tqdm

    device, out = _device(model), []
    rows = sum(len(ks) for ks in chosen) if chosen is not None else None
    bar = tqdm(total=len(windows), desc=f"masked perplexity, one row per position ({rows or 'all'} rows)",
               unit="window", disable=not progress)
    for index, w in enumerate(windows):
        ks = list(chosen[index]) if chosen is not None else list(range(w.first_scored, len(w.input_ids)))
        bar.update(1)
        nll, flags = [], ([] if greedy is not None else None)
        for i in range(0, len(ks), batch_size):
            chunk = ks[i : i + batch_size]
            if two_stream:
                # the plan masked pretraining trained: BOS rank 0, the prefix one group (bidirectional), the
                # target alone in the next group (masking_lookaround.infilling_ranks)
                ids, mask = _pad([w.input_ids[: k + 1] for k in chunk], pad)
                hidden = torch.zeros_like(ids, dtype=torch.bool)
                rows = torch.arange(len(chunk))
                hidden[rows, torch.tensor(chunk)] = True
                is_condition = torch.zeros_like(hidden)
                is_condition[:, 0] = bool(w.offset)  # the window starts with the document's BOS
                group_ids = infilling_ranks(hidden, is_condition)
                targets = torch.tensor(chunk).unsqueeze(-1)
                logits = _two_stream_logits(model, ids, mask, group_ids, targets, device)[:, 0]
            else:
                ids, mask = _pad([w.input_ids[:k] + [mask_id] for k in chunk], pad)
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                logits = logits[torch.arange(len(chunk), device=device), torch.tensor(chunk, device=device)]
            gold = torch.tensor([w.input_ids[k] for k in chunk], device=device)
            nll.append(_scored(logits, gold, flags))
        out.append(torch.cat(nll))
        if greedy is not None:
            greedy.append(torch.cat(flags))
    bar.close()
    return out


def _result(protocol, nlls, prefixes, num_bytes, max_length, stride) -> PerplexityResult:
    nlls = torch.cat(nlls).double().numpy()
    prefixes = np.concatenate(prefixes)
    return PerplexityResult(protocol, nlls, prefixes, num_bytes, {"max_length": max_length, "stride": stride})


# ---------------------------------------------------------------------------------------------
# reporting by prefix length
# ---------------------------------------------------------------------------------------------


def default_buckets(max_prefix: int) -> list[int]:
    """Bucket edges 0, 1, 2, 4, 8, ... (powers of two) past ``max_prefix``."""
    edges = [0, 1]
    while edges[-1] <= max_prefix:
        edges.append(edges[-1] * 2)
    return edges


def bucket_by_prefix_length(nlls: np.ndarray, prefix_lengths: np.ndarray, buckets=None) -> list[dict]:
    """Perplexity of the tokens whose prefix length lies in ``[edges[i], edges[i+1])``."""
    if nlls.size == 0:
        return []
    edges = list(buckets) if buckets else default_buckets(int(prefix_lengths.max()))
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        chosen = (prefix_lengths >= lo) & (prefix_lengths < hi)
        if chosen.any():
            mean = float(nlls[chosen].mean())
            rows.append(
                {
                    "prefix_length_min": int(lo),
                    "prefix_length_max": int(hi - 1),
                    "num_tokens": int(chosen.sum()),
                    "nll": mean,
                    "perplexity": float(math.exp(mean)),
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| prefix length | tokens | NLL (nats) | perplexity |", "| --- | --- | --- | --- |"]
    for r in rows:
        span = f"{r['prefix_length_min']}" if r["prefix_length_min"] == r["prefix_length_max"] else (
            f"{r['prefix_length_min']}-{r['prefix_length_max']}"
        )
        lines.append(f"| {span} | {r['num_tokens']} | {r['nll']:.4f} | {r['perplexity']:.2f} |")
    return "\n".join(lines)


def plot_by_prefix_length(rows: list[dict], path, title: str = "") -> None:
    """Perplexity against prefix length (paper (a) Fig. 3), one point per bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centers = [max(0.5, (r["prefix_length_min"] + r["prefix_length_max"]) / 2) for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(centers, [r["perplexity"] for r in rows], marker="o")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix length k (tokens visible before the target)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# the ELBO protocol (diffusion checkpoints: mdlm, bd3lm)
# ---------------------------------------------------------------------------------------------
@dataclass
class ElboResult(PerplexityResult):
    """The negative ELBO per token of a diffusion checkpoint, a bound on its NLL: a Monte-Carlo estimate over
    ``num_samples`` draws of times and masks, with its standard error (of the NLL per token, in nats)."""

    num_samples: int = 0
    standard_error: float = 0.0

    def to_dict(self, dataset: str | None = None, buckets=None) -> dict:
        return {
            "dataset": dataset,
            "protocol": self.protocol,
            "elbo_perplexity": self.perplexity,  # exp(negative ELBO per token): an upper bound on the perplexity
            "bits_per_byte": self.bits_per_byte,
            "num_tokens": self.num_tokens,
            "num_bytes": int(self.num_bytes),
            "nll_per_token": self.mean_nll,  # the negative ELBO per token (nats)
            "num_samples": self.num_samples,
            "standard_error": self.standard_error,
            "perplexity_interval": [float(math.exp(self.mean_nll - 2 * self.standard_error)),
                                    float(math.exp(self.mean_nll + 2 * self.standard_error))],
            **self.extra,
            "by_prefix_length": [],  # a bound on a whole window, not a number per prefix
        }


def format_elbo_table(report: dict) -> str:
    low, high = report["perplexity_interval"]
    return "\n".join([
        "| negative ELBO (nats/token) | standard error | ELBO perplexity (bound) | +-2 SE | samples | tokens |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {report['nll_per_token']:.4f} | {report['standard_error']:.4f} | {report['elbo_perplexity']:.2f} | "
        f"{low:.2f}-{high:.2f} | {report['num_samples']} | {report['num_tokens']} |",
    ])


def elbo_window_nlls(model, rows: list[list[int]], num_condition_tokens: int, num_samples: int, generator,
                     pad_id: int, mask_id: int | None = None) -> np.ndarray:
    """(num_samples, len(rows)): Monte-Carlo samples of each row's negative ELBO summed over its tokens after the
    first ``num_condition_tokens`` (a visible condition), with the plan the checkpoint's objective trained
    (``elbo_plan`` of its module). Two-stream checkpoints predict with the query stream; single-stream ones
    (``LookAroundForMaskedLM``) read ``[MASK]`` inputs."""
    ids, attention = _pad(rows, pad_id)
    totals = np.zeros((num_samples, len(rows)))
    for s in range(num_samples):
        plan = draw_elbo_plan(model, attention.sum(1), ids.shape[1], num_condition_tokens, generator)
        totals[s] = elbo_plan_nlls(model, ids, attention, plan, num_condition_tokens, mask_id)
    return totals


MASKED_CHECKPOINT_BOUND = "mdlm"  # the bound a masked checkpoint without a diffusion objective is scored by


def elbo_objective(config, asked: str = "the elbo protocol",
                   otherwise: str = "score it with --protocol ar or masked") -> tuple[str, dict]:
    """The diffusion objective whose ELBO scores a checkpoint, and the plan parameters it was trained with: the
    checkpoint's own objective (mdlm, bd3lm), or the one diffusion component of a mixture (e.g. mdlm + vmlm) with
    that component's parameters. A masked checkpoint without one (mlm, vmlm, span, their mixtures) is scored by
    MDLM's bound with its default (linear) schedule: MDLM's ELBO bounds the likelihood of any predictor of masked
    tokens from the visible ones, whatever masking rates it trained on (LLaDA and dllm score masked models so).
    Else a one-line ValueError: no such objective, or a mixture of two diffusion objectives (mdlm + bd3lm: two
    bounds, and no rule makes one of them the checkpoint's). ``asked`` names what needs the ELBO and ``otherwise``
    what to do instead, as the calling command spells them."""
    objective, params = getattr(config, "objective", None), getattr(config, "plan_params", None)
    found = objectives.diffusion_components(objective, params)
    if len(found) == 1:
        return next(iter(found.items()))
    if not found and objectives.families(objective, params) == (objectives.MASKED,):
        return MASKED_CHECKPOINT_BOUND, {}
    if not found:
        diffusion = [n for n, o in objectives.OBJECTIVES.items() if o.elbo_plan is not None]
        raise ValueError(f"{asked} needs a checkpoint trained with a diffusion objective {diffusion} or a masked one "
                         f"(or a mixture of them), got objective={objective!r}; {otherwise}")
    raise ValueError(f"{asked}: this mixture has {len(found)} diffusion components {list(found)}, each with its own "
                     f"bound, and a checkpoint is scored by one; {otherwise}")


def draw_elbo_plan(model, lengths: torch.Tensor, width: int, num_condition_tokens: int, generator):
    """One draw of times and masks per row: the ``elbo_plan`` of the checkpoint's diffusion objective (a mixture's:
    its diffusion component's), with the plan parameters it trained with (noise schedule, block size):
    :func:`elbo_objective`."""
    name, params = elbo_objective(model.config)
    return objectives.get(name).elbo_plan(lengths, width, num_condition_tokens=num_condition_tokens,
                                          generator=generator, **params)


def elbo_plan_nlls(model, ids: torch.Tensor, attention: torch.Tensor, plan, num_condition_tokens: int,
                   mask_id: int | None = None) -> np.ndarray:
    """(B,): each row's negative ELBO under one drawn ``plan`` (:func:`draw_elbo_plan`), summed over its tokens
    after the first ``num_condition_tokens``: one forward."""
    device = _device(model)
    counted = (attention.sum(1) - num_condition_tokens).clamp(min=0).double()
    weights = plan.loss_weights.double() * counted[:, None]  # each row's sum of weight * NLL: its total
    if is_two_stream(model):
        slots = plan.target_positions()
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device),
                       group_ids=plan.group_ids.to(device), target_positions=slots.to(device)).logits
        nll = _nll(logits, ids.gather(1, slots.clamp(min=0)).to(device)).double().cpu()
        nll = torch.where(slots >= 0, nll * weights.gather(1, slots.clamp(min=0)), 0.0)
    elif is_block_diffusion_model(model.config):  # bd3lm's one-stream form: x_t ⊕ x_0, blocks after the condition
        batch = one_stream_layout(ids, attention, plan, mask_id)
        clean_rank = plan.group_ids - plan.is_target.long()  # the plan's blocks, whatever the condition's length
        layout = block_diffusion_layout(clean_rank.to(device), torch.cat([attention, attention], 1).to(device))
        masks = build_prepared_attention(layout, model.config._attn_implementation, model.dtype, layout.key_rank.shape[1],
                                         with_query_rows=False)
        positions = torch.arange(ids.shape[1], device=device).repeat(ids.shape[0], 2)
        logits = model(input_ids=batch["input_ids"].to(device), position_ids=positions, prepared_attention=masks,
                       one_stream_layout=True).logits[:, : ids.shape[1]]
        nll = torch.where(plan.is_target, _nll(logits, ids.to(device)).double().cpu() * weights, 0.0)
    else:
        inputs = torch.where(plan.is_target, mask_id, ids)
        logits = model(input_ids=inputs.to(device), attention_mask=attention.to(device)).logits
        nll = torch.where(plan.is_target, _nll(logits, ids.to(device)).double().cpu() * weights, 0.0)
    return nll.sum(1).numpy()


@torch.inference_mode()
def elbo_perplexity(model, tokenizer, texts, max_length=512, stride=256, batch_size=8, add_bos=None,
                    num_samples: int = 16, seed: int = 0) -> ElboResult:
    """The negative ELBO per token of a diffusion checkpoint (MDLM's; BD3-LM's for a block model; MDLM's for a
    masked checkpoint: :func:`elbo_objective`), a bound on its NLL, as a perplexity ``exp(negative ELBO per token)``
    with the standard error of the Monte-Carlo estimate.

    Windows are the AR protocol's (``sliding_windows``): the tokens before a window's first scored one (BOS, or
    the window's context) are the visible condition, and the scored tokens' negative ELBO given them is estimated
    from ``num_samples`` draws of times and masks (seeded by ``seed``; BD3-LM's times from ``(eps, 1]``, not the
    training clip). Sample ``s`` of every window gives one corpus estimate; their mean is the result and their
    spread over ``sqrt(num_samples)`` its standard error."""
    objective = getattr(model.config, "objective", None)
    diffusion, _ = elbo_objective(model.config)  # refused here in one line, before any window is scored
    if num_samples < 2:
        raise ValueError(f"num_samples must be >= 2 (the standard error needs two samples), got {num_samples}")
    mask_id = getattr(tokenizer, "mask_token_id", None)
    mask_id = getattr(model.config, "mask_token_id", None) if mask_id is None else mask_id
    if not is_two_stream(model) and mask_id is None:
        raise ValueError("a single-stream diffusion checkpoint reads [MASK] inputs: the tokenizer and config have none")
    docs, num_bytes, has_bos = encode_documents(tokenizer, texts, add_bos)
    windows = _windows_of(docs, max_length, stride, has_bos)
    pad, generator = _pad_id(model, tokenizer), torch.Generator().manual_seed(seed)
    totals = np.zeros((num_samples, len(windows)))
    by_condition: dict[int, list[int]] = {}  # a plan takes one condition length per batch
    for i, w in enumerate(windows):
        by_condition.setdefault(w.first_scored, []).append(i)
    for condition, indices in sorted(by_condition.items()):
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            totals[:, chunk] = elbo_window_nlls(model, [windows[i].input_ids for i in chunk], condition, num_samples,
                                                generator, pad, mask_id)
    prefixes = np.concatenate([w.prefix_lengths() for w in windows])
    per_token = totals.sum(1) / prefixes.size  # one corpus estimate per sample
    # every scored token carries its window's mean: the corpus mean and bits per byte are the estimate's
    nlls = np.concatenate([np.full(len(w.prefix_lengths()), totals[:, i].mean() / len(w.prefix_lengths()))
                           for i, w in enumerate(windows)])
    result = ElboResult("elbo", nlls, prefixes, num_bytes, {"max_length": max_length, "stride": stride,
                                                            "objective": objective, "elbo_objective": diffusion,
                                                            "seed": seed},
                        num_samples=num_samples,
                        standard_error=float(per_token.std(ddof=1) / math.sqrt(num_samples)))
    return result
