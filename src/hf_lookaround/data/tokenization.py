"""Tokenizers with no hub: train a byte-level BPE on local text (`hf-lookaround train-tokenizer`).

The result is saved so that ``AutoTokenizer.from_pretrained(dir)`` returns it: a
``PreTrainedTokenizerFast`` with ``[PAD]``, ``[MASK]``, ``[UNK]``, BOS ``<s>`` and EOS ``</s>``
(``<s>``/``</s>`` also serve as CLS/SEP, as in RoBERTa), and a post-processor that starts every
sequence with ``<s>``, the condition token of group rank 0, so that the autoregressive plan predicts
every real token. A single text gets no ``</s>``: ``tokenizer(text)`` is a prompt to continue (as with
GPT-2 and Llama tokenizers), and a prompt that ends with EOS asks for a text after the end of a
finished one. A pair is ``<s> A </s> B </s>``; :func:`encode_sentences` gives classification inputs
``<s> A </s>`` for single sentences too. Pretraining and perplexity add BOS/EOS themselves
(``add_special_tokens=False``). Tokenizers saved before this change keep their ``<s> ... </s>`` template
and load as they are. Byte-level BPE never needs ``[UNK]``; it is there for code that expects one.

A user with a network can pass any hub tokenizer name to the pretraining script instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["SPECIAL_TOKENS", "check_tokenizer_settings", "train_tokenizer", "encode_sentences", "tokenizer_files"]

BOS, EOS, PAD, MASK, UNK = "<s>", "</s>", "[PAD]", "[MASK]", "[UNK]"
# the order fixes the ids: [PAD] = 0, <s> = 1, </s> = 2, [UNK] = 3, [MASK] = 4
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, MASK)


# the files by which a folder holds a tokenizer (of this package, or any that AutoTokenizer loads)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def tokenizer_files(folder) -> list[str]:
    """The tokenizer files that ``folder`` already holds (empty when it holds none, or is no folder)."""
    folder = Path(folder)
    return [name for name in TOKENIZER_FILES if (folder / name).is_file()] if folder.is_dir() else []


# the files that hold a vocabulary: without one of them AutoTokenizer fails talking of sentencepiece and tiktoken
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                    "sentencepiece.bpe.model")


LOAD_ONLY_ARGUMENTS = ("is_local", "local_files_only")


def auto_tokenizer(name_or_path, **kwargs):
    """``AutoTokenizer.from_pretrained``; a local folder that holds no vocabulary (no tokenizer.json) is refused
    with one line that says which file is missing. What the tokenizer saves again omits how it was loaded."""
    from transformers import AutoTokenizer

    folder = Path(name_or_path)
    if folder.is_dir() and not any((folder / name).is_file() for name in VOCABULARY_FILES):
        found = ", ".join(tokenizer_files(folder)) or "no tokenizer file"
        raise ValueError(f"{folder} holds no tokenizer: tokenizer.json is missing (found {found}); give the folder "
                         "that hf-lookaround train-tokenizer or pretrain wrote, or copy its tokenizer.json here")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except Exception:
        if folder.is_dir():  # a cut tokenizer.json or tokenizer_config.json: tokenizers' message names no file
            from .records import load_json_file

            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (folder / name).is_file():
                    load_json_file(folder / name)
        raise
    # transformers records how this copy was loaded (from a local folder, offline) among the arguments it saves
    # again: a checkpoint uploaded to the Hub would then tell its users' loads `local_files_only: true`
    for key in LOAD_ONLY_ARGUMENTS:
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


# the most tokens a byte-level BPE may have: past this the trainer allocates tens of GB (1e9 aborted allocating 70 GB)
MAX_VOCAB_SIZE = 1_000_000


def check_tokenizer_settings(vocab_size: int, min_frequency: int = 2, model_max_length: int | None = None) -> None:
    """Values the tokenizers trainer would take and then fail on (an overflow, an abort), refused in one line."""
    if not 256 + len(SPECIAL_TOKENS) <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens) and at "
                         f"most {MAX_VOCAB_SIZE:,}, got {vocab_size}")
    if min_frequency < 0:
        raise ValueError(f"min_frequency must be >= 0 (how often a pair must occur to be merged), got {min_frequency}")
    if model_max_length is not None and model_max_length < 1:
        raise ValueError(f"model_max_length must be a positive number of tokens, got {model_max_length}")


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

    check_tokenizer_settings(vocab_size, min_frequency, model_max_length)
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
    # trim_offsets=False keeps the offsets of the byte-level pieces; the template adds <s> in front (a single
    # text is a prompt: no </s>), and separates a pair as <s> A </s> B </s>
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
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


def _single_lacks_end_token(tokenizer) -> int | None:
    """The end token a single sentence lacks where a pair has it after its first text (this package's tokenizers
    since prompts end without EOS); None when a single sentence gets the same end as a pair (BERT, RoBERTa, older
    tokenizers of this package) or the tokenizer has no such token (GPT-2)."""
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if end is None:
        return None
    single = tokenizer("a")["input_ids"]
    pair = tokenizer("a", "b")["input_ids"]
    if single and single[-1] == end:
        return None
    return end if end in pair[len(single) - 1:] else None


def encode_sentences(tokenizer, texts, text_pairs=None, *, truncation: bool = False, max_length: int | None = None,
                     padding: bool = False, return_tensors: str | None = None):
    """Classification inputs with their special tokens: ``tokenizer(texts, text_pairs)``, except that a single
    sentence ends with the end token a pair puts after its first text (``<s> A </s>``), also with tokenizers that
    add none to a single text, whose single texts are prompts. Fine-tuning, probing and feature extraction thus see
    the inputs they saw before prompts lost their EOS. Truncation keeps the end token."""
    from transformers import BatchEncoding

    args = (texts,) if text_pairs is None else (texts, text_pairs)
    end = _single_lacks_end_token(tokenizer) if text_pairs is None else None
    if end is None:
        return tokenizer(*args, truncation=truncation, max_length=max_length, padding=padding,
                         return_tensors=return_tensors)
    limit = max_length - 1 if (truncation and max_length is not None) else None
    single = isinstance(texts, str)
    enc = tokenizer([texts] if single else texts, truncation=limit is not None, max_length=limit)
    enc = {key: [row + [end if key == "input_ids" else (row[-1] if key == "token_type_ids" else 1)] for row in rows]
           for key, rows in enc.items()}
    if padding or return_tensors:  # a batch (of one for a single string, as tokenizer(str, return_tensors=...))
        return tokenizer.pad(enc, padding=padding or "longest", return_tensors=return_tensors)
    return BatchEncoding({key: rows[0] for key, rows in enc.items()} if single else enc)

