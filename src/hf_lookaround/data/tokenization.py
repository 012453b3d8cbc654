"""Tokenizers with no hub: train a byte-level BPE on local text (`hf-lookaround train-tokenizer`).

The result is saved so that ``AutoTokenizer.from_pretrained(dir)`` returns it: a
``PreTrainedTokenizerFast`` with ``[PAD]``, ``[MASK]``, ``[UNK]``, BOS ``<s>`` and EOS ``</s>``
(``<s>``/``</s>`` also serve as CLS/SEP, as in RoBERTa), and a post-processor that wraps every
sequence as ``<s> ... </s>``: sequences start with a condition token of group rank 0, so the
autoregressive plan predicts every real token. Byte-level BPE never needs ``[UNK]``; it is there
for code that expects one.

A user with a network can pass any hub tokenizer name to the pretraining script instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["SPECIAL_TOKENS", "train_tokenizer"]

BOS, EOS, PAD, MASK, UNK = "<s>", "</s>", "[PAD]", "[MASK]", "[UNK]"
# the order fixes the ids: [PAD] = 0, <s> = 1, </s> = 2, [UNK] = 3, [MASK] = 4
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, MASK)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    min_frequency: int = 2,
    model_max_length: int | None = None,
    output_dir: str | None = None,
    show_progress: bool = False,
):
    """Train a byte-level BPE on ``texts`` and return a ``PreTrainedTokenizerFast`` (saved to ``output_dir`` if given)."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens), got {vocab_size}")
    if output_dir is not None and Path(output_dir).exists() and not Path(output_dir).is_dir():
        # save_pretrained would only log an error and save nothing
        raise ValueError(f"--output_dir {output_dir} is a file, not a folder: a tokenizer is saved as several files "
                         "in a folder; give a folder path")
    texts = _non_empty(texts)
    first = next(texts, None)
    if first is None:
        raise ValueError("no text to train the tokenizer on: the input is empty")

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_chain(first, texts), trainer=trainer)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    # trim_offsets=False keeps the offsets of the byte-level pieces; the template adds <s> ... </s>
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A {EOS}",
                pair=f"{BOS} $A {EOS} $B:1 {EOS}:1",
                special_tokens=[(BOS, bos), (EOS, eos)],
            ),
        ]
    )
    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        unk_token=UNK,
        cls_token=BOS,
        sep_token=EOS,
        padding_side="right",
        **kwargs,
    )
    if output_dir is not None:
        fast.save_pretrained(output_dir)
    return fast


def _non_empty(texts: Iterable[str]) -> Iterator[str]:
    return (t for t in texts if t and not t.isspace())


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest
