"""Text data for pretraining: local files or folders, or a `datasets` name, chunked into blocks.

Local inputs: ``.txt`` (one document per file), ``.jsonl`` / ``.jsonl.gz`` / ``.json`` (one
document per record, in ``text_column``), or folders holding such files (read recursively, in
sorted order). Anything that is not an existing path is taken as a ``datasets`` name,
``name`` or ``name:config`` (needs a network or a local cache).

:func:`chunk_into_blocks` concatenates the documents, with EOS after each, and cuts the stream
into blocks of ``block_size - 1`` tokens, each prefixed with BOS: every block starts with a
condition token of rank 0, so the autoregressive plan predicts every real token of the block.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

__all__ = ["TEXT_SUFFIXES", "find_files", "iter_texts", "load_texts", "chunk_into_blocks"]

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".json", ".json.gz", ".txt.gz")


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(TEXT_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def find_files(path: str | Path) -> list[Path]:
    """The text files of ``path`` (a file, or a folder searched recursively), in sorted order."""
    path = Path(path)
    if path.is_file():
        if _suffix(path) is None:
            raise ValueError(f"{path}: unsupported file type; use one of {TEXT_SUFFIXES}")
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p) is not None)
    raise FileNotFoundError(path)


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")


def _read_file(path: Path, text_column: str) -> Iterator[str]:
    suffix = _suffix(path)
    with _open(path) as f:
        if suffix.startswith(".txt"):
            yield f.read()
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_column not in record:
                raise ValueError(f"{path}:{lineno}: no field {text_column!r} (fields: {sorted(record)}); set --text_column")
            yield record[text_column]


def _iter_dataset(name: str, text_column: str, split: str) -> Iterator[str]:
    import datasets

    repo, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as err:  # offline, unknown name, missing split: say what was tried
        raise ValueError(
            f"{name!r} is not an existing file or folder, and loading it as a `datasets` name (split {split!r}) "
            f"failed: {err}"
        ) from err
    if text_column not in ds.column_names:
        raise ValueError(f"dataset {name!r} has no column {text_column!r} (columns: {ds.column_names}); set --text_column")
    yield from ds[text_column]


def iter_texts(inputs: str | Sequence[str], text_column: str = "text", split: str = "train") -> Iterator[str]:
    """Yield the non-empty documents of ``inputs`` (paths or `datasets` names), in order."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    for item in inputs:
        path = Path(item)
        sources = (_read_file(p, text_column) for p in find_files(path)) if path.exists() else [
            _iter_dataset(str(item), text_column, split)
        ]
        for source in sources:
            for text in source:
                if text and not text.isspace():
                    yield text


def load_texts(inputs, text_column: str = "text", split: str = "train") -> list[str]:
    """All documents of ``inputs``; a clear error when there are none."""
    texts = list(iter_texts(inputs, text_column, split))
    if not texts:
        raise ValueError(f"no text found in {inputs!r} (files: {TEXT_SUFFIXES}, field {text_column!r})")
    return texts


def chunk_into_blocks(texts: Iterable[str], tokenizer, block_size: int, batch_size: int = 256):
    """Tokenize, concatenate (EOS after each document) and cut into BOS-prefixed blocks of ``block_size``.

    Returns a ``datasets.Dataset`` with one column, ``input_ids``. The tail shorter than a block is dropped.
    """
    import datasets

    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (BOS + at least one token), got {block_size}")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    if bos is None:
        raise ValueError("the tokenizer has neither a BOS nor a CLS token to start each block with")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    body = block_size - 1

    blocks: list[list[int]] = []
    buffer: list[int] = []
    batch: list[str] = []

    def flush():
        nonlocal buffer
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            buffer.extend(ids)
            if eos is not None:
                buffer.append(eos)
        full = len(buffer) // body
        blocks.extend([bos] + buffer[i * body : (i + 1) * body] for i in range(full))
        buffer = buffer[full * body :]
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    if not blocks:
        raise ValueError(
            f"the data holds {len(buffer)} tokens, fewer than one block of {block_size}: "
            "give more text or a smaller --block_size"
        )
    return datasets.Dataset.from_dict({"input_ids": blocks})
