"""Text data for pretraining, built with `datasets`: Arrow-backed, cached, and never a Python list of the corpus.

Inputs are local files or folders (read recursively, in sorted order), or a ``datasets`` name
(``name`` or ``name:config``; needs a network or a local cache):

- ``.txt`` / ``.txt.gz``: one document per file (the ``text`` builder, ``sample_by="document"``);
- ``.jsonl`` / ``.json`` (``.gz``): one document per record, in ``text_column`` (the ``json`` builder);
- ``.parquet``: one document per row, in ``text_column`` (the ``parquet`` builder).

:func:`load_text_dataset` loads them with ``load_dataset`` (map-style ``Dataset``, cached as Arrow under
``cache_dir``; or an ``IterableDataset`` with ``streaming=True``). :func:`build_blocks` turns a text
dataset into training blocks with two ``.map`` calls:

1. **tokenize** (``batched=True``, ``num_proc``): each non-empty document becomes its tokens followed by
   EOS; empty and whitespace-only documents are skipped;
2. **pack**: the documents' tokens form one stream, cut into bodies of ``block_size - 1`` tokens, each
   prefixed with BOS, so that every block starts with a condition token of rank 0 and the
   autoregressive plan predicts every real token of the block.

Packing loses nothing but the end of the stream. Map-style data is packed *globally*: the tokenized
documents are read back as one memory-mapped token stream, so a block may span packing batches (and
``num_proc`` shards), and only the last ``len(stream) % (block_size - 1)`` tokens of the whole corpus
are dropped (reported in :class:`PackingStats` and logged). A stream (``streaming=True``) carries the
tokens left over at the end of each packing batch into the next one; only the tail of the stream,
fewer than ``block_size - 1`` tokens per pass and per data-loader worker, is dropped. On the same
documents in one process both paths give the same blocks.

The map-style results are cached by ``datasets`` with fingerprints that name the text, the tokenizer
(its serialized form), the special tokens and the block size: a second build with the same arguments
loads the cached Arrow files instead of tokenizing again.

:func:`split_for_rank` splits a stream across ranks with ``datasets.distributed.split_dataset_by_node``.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import records

logger = logging.getLogger(__name__)

__all__ = [
    "TEXT_SUFFIXES",
    "PackingStats",
    "find_files",
    "iter_texts",
    "load_texts",
    "load_text_dataset",
    "iter_dataset_texts",
    "tokenize_documents",
    "pack_blocks",
    "build_blocks",
    "split_for_rank",
    "disk_full_is_one_line",
    "is_split_by_node",
    "rank_local_prepare",
    "chunk_into_blocks",
    "special_token_ids",
]

TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
# the `datasets` packaged builder that reads each kind of file
_BUILDERS = {".txt": "text", ".txt.gz": "text", ".jsonl": "json", ".jsonl.gz": "json", ".json": "json",
             ".json.gz": "json", ".parquet": "parquet"}
# bump when the tokenize or pack functions change, so that old cache files are not reused
_FORMAT_VERSION = "blocks-v1"


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(TEXT_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def find_files(path: str | Path) -> list[Path]:
    """The text files of ``path`` (a file, or a folder searched recursively), in sorted order."""
    path = Path(path)
    if records.is_devnull(path):
        raise ValueError(f"{path}: the file is empty (it is {os.devnull}); give a file that holds documents")
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ValueError(f"{path}: not a regular file (a device, pipe or socket); give a data file or folder")
    if path.is_file():
        if _suffix(path) is None:
            raise ValueError(f"{path}: unsupported file type; use one of {TEXT_SUFFIXES}")
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p) is not None)
    raise FileNotFoundError(path)


def special_token_ids(tokenizer) -> tuple[int, int | None]:
    """``(bos, eos)``: the condition token that starts each block (BOS, else CLS) and the document separator."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    if bos is None:
        raise ValueError(
            "the tokenizer has neither a BOS nor a CLS token to start each block with (the rank-0 condition "
            "token): use a tokenizer with one, e.g. --train_tokenizer, or set tokenizer.bos_token"
        )
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return bos, eos


# ---------------------------------------------------------------------------------------------
# Plain readers (small inputs: the tokenizer CLI, tests). The training data goes through `datasets`.
# ---------------------------------------------------------------------------------------------
def _read_file(path: Path, text_column: str) -> Iterator[str]:
    yield from records.read_documents(path, text_column)


def _iter_hub_dataset(name: str, text_column: str, split: str) -> Iterator[str]:
    ds = load_text_dataset(name, text_column=text_column, split=split, streaming=True)
    yield from iter_dataset_texts(ds, text_column)


def iter_texts(inputs: str | Sequence[str], text_column: str = "text", split: str = "train") -> Iterator[str]:
    """Yield the non-empty documents of ``inputs`` (paths or `datasets` names), in order, one at a time; every
    record of a local file is checked first (:mod:`records`), and inputs that hold no document are refused."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    local = [p for item in inputs if Path(item).exists() for p in find_files(item)]
    empty = [p for p in local if records.check_file(p, text_column) == 0]
    if local and len(empty) == len(local) == len(inputs):
        raise ValueError(f"no text in {', '.join(map(str, empty))}: the file(s) are empty; give files that hold "
                         "documents")
    return _iter_texts(inputs, text_column, split)


def _iter_texts(inputs, text_column: str, split: str) -> Iterator[str]:
    found = 0
    for item in inputs:
        path = Path(item)
        sources = (_read_file(p, text_column) for p in find_files(path)) if path.exists() else [
            _iter_hub_dataset(str(item), text_column, split)
        ]
        for source in sources:
            for text in source:
                if text and not text.isspace():
                    found += 1
                    yield text
    if not found:
        raise ValueError(f"no text found in {', '.join(map(str, inputs))}: every document is empty (field "
                         f"{text_column!r})")


def load_texts(inputs, text_column: str = "text", split: str = "train") -> list[str]:
    """All documents of ``inputs`` as a list (small inputs only); a clear error when there are none."""
    texts = list(iter_texts(inputs, text_column, split))
    if not texts:
        raise ValueError(f"no text found in {inputs!r} (files: {TEXT_SUFFIXES}, field {text_column!r})")
    return texts


# ---------------------------------------------------------------------------------------------
# Loading with `datasets`
# ---------------------------------------------------------------------------------------------
def load_text_dataset(inputs: str | Sequence[str], text_column: str = "text", split: str = "train",
                      streaming: bool = False, cache_dir: str | None = None, config_name: str | None = None):
    """A ``Dataset`` (or, with ``streaming``, an ``IterableDataset``) with the one column ``text_column``.

    ``inputs``: files, folders or one `datasets` name (``name`` or ``name:config``). Local files are
    loaded with the ``text``/``json``/``parquet`` builders, one ``load_dataset`` call per run of files of
    the same kind, concatenated in sorted-path order. ``.txt`` files hold one document each, whatever
    ``text_column`` is called.
    """
    import datasets

    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    inputs = [str(i) for i in inputs]
    if not inputs:
        raise ValueError("no training data given: pass --train_files FILES_OR_FOLDERS or --dataset_name NAME")
    missing = [i for i in inputs if not Path(i).exists()]
    if missing:
        if len(inputs) > 1:
            raise ValueError(f"not an existing file or folder: {missing} (a `datasets` name must be given alone)")
        return _load_hub(inputs[0], text_column, split, streaming, cache_dir, config_name)

    files = [p for i in inputs for p in find_files(i)]
    if not files:
        raise ValueError(f"no text found in {inputs!r}: no files of the types {TEXT_SUFFIXES}")
    # every record is checked before `datasets` sees it (Arrow's reader segfaults on deep nesting, stringifies
    # nothing, names no line); empty files are left out (`datasets` fails on them with a bare StopIteration)
    empty = [p for p in files if records.check_file(p, text_column) == 0]
    if len(empty) == len(files):
        raise ValueError(f"no text in {', '.join(map(str, empty))}: the file(s) are empty; give files that hold "
                         f"documents ({split} data)")
    if empty:
        logger.warning("skipping %d empty file(s) of the %s data: %s", len(empty), split, ", ".join(map(str, empty)))
        files = [p for p in files if p not in empty]
    parts = []
    for (builder, _), group in itertools.groupby(files, key=_file_kind):
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        group = list(group)
        with disk_full_is_one_line(cache_dir):
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in group], split="train",
                                       streaming=streaming, cache_dir=cache_dir, **kwargs)
        if builder == "text" and text_column != "text":
            ds = ds.rename_column("text", text_column)
        ds = _only_text_column(ds, text_column, f"{builder} files")
        parts.append(ds)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _file_kind(path: Path) -> tuple[str, object]:
    """(builder, field names): one ``load_dataset`` call reads a run of files with the same fields.

    A builder call casts every file to one schema, so JSON Lines files whose records have other fields
    (``genre`` in one corpus, ``chapter`` in another) must be loaded apart and concatenated."""
    builder = _BUILDERS[_suffix(path)]
    if builder == "text":
        return builder, None
    if builder == "parquet":
        import pyarrow.parquet as pq

        return builder, tuple(pq.read_schema(path).names)
    first = next((line for _, line in records.read_lines(path) if line.strip()), "")
    if first.lstrip().startswith("[") and not first.rstrip().endswith("}"):  # a .json array: that file alone
        return builder, str(path)
    return builder, tuple(sorted(_first_record(path) or ()))


def _first_record(path: Path):
    """The first record of a JSON data file (None: there is none), checked by :mod:`records`."""
    return next((record for _, record in records.read_records(path)), None)


@contextmanager
def disk_full_is_one_line(cache_dir):
    """Turn a full disk under the ``datasets`` cache (an ``OSError`` wrapped in ``DatasetGenerationError`` or
    raised by ``.map``'s writer) into one line naming the cache folder."""
    try:
        yield
    except Exception as err:
        cause = err
        while cause is not None and not (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        import datasets

        folder = cache_dir or datasets.config.HF_DATASETS_CACHE
        raise ValueError(f"no space left on the disk of the datasets cache ({folder}) while preparing the data: free "
                         "space there, or give --cache_dir a folder on a larger disk") from None


def _load_hub(name: str, text_column: str, split: str, streaming: bool, cache_dir, config_name):
    import datasets

    repo, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, config or config_name, split=split, streaming=streaming, cache_dir=cache_dir)
    except Exception as err:  # offline, unknown name, missing split: say what was tried
        raise ValueError(
            f"{name!r} is not an existing file or folder, and loading it as a `datasets` name (split {split!r}) "
            f"failed: {err}"
        ) from err
    return _only_text_column(ds, text_column, f"dataset {name!r}")


def _only_text_column(ds, text_column: str, what: str):
    import datasets

    names = ds.column_names
    if names is None:  # a stream whose features are not known before reading: checked when tokenizing
        return ds
    if text_column not in names:
        raise ValueError(f"{what}: no field {text_column!r} (fields: {names}); set --text_column")
    ds = ds.select_columns([text_column])
    if ds.features is not None and ds.features[text_column] != datasets.Value("string"):
        ds = ds.cast_column(text_column, datasets.Value("string"))  # e.g. parquet large_string
    return ds


def iter_dataset_texts(ds, text_column: str = "text", max_documents: int | None = None,
                       batch_size: int = 1000) -> Iterator[str]:
    """The non-empty documents of a (possibly streaming) text dataset, read batch by batch."""
    count = 0
    for batch in ds.select_columns([text_column]).iter(batch_size=batch_size):
        for text in batch[text_column]:
            if text and not text.isspace():
                yield text
                count += 1
                if max_documents is not None and count >= max_documents:
                    return


# ---------------------------------------------------------------------------------------------
# Tokenize and pack
# ---------------------------------------------------------------------------------------------
@dataclass
class PackingStats:
    """What packing made of a map-style dataset. ``dropped_tokens`` is the end of the stream (< one body)."""

    documents: int
    tokens: int
    blocks: int
    block_size: int
    dropped_tokens: int

    def describe(self) -> str:
        return (f"{self.documents:,} documents, {self.tokens:,} tokens (EOS included) -> {self.blocks:,} blocks of "
                f"{self.block_size} (BOS + {self.block_size - 1}); {self.dropped_tokens:,} tokens dropped at the "
                f"end of the stream ({100 * self.dropped_tokens / max(self.tokens, 1):.4f} %)")


class _Tokenize:
    """Batched map function: the tokens of each non-empty document, then EOS."""

    def __init__(self, tokenizer, text_column: str, eos: int | None):
        self.tokenizer, self.text_column, self.eos = tokenizer, text_column, eos

    def __call__(self, batch):
        import numpy as np

        if self.text_column not in batch:
            raise ValueError(f"no field {self.text_column!r} in the data (fields: {sorted(batch)}); set --text_column")
        texts = [t for t in batch[self.text_column] if t and not t.isspace()]
        if not texts:
            return {"input_ids": []}
        # verbose=False: documents longer than model_max_length are expected here (packing cuts them)
        ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                             return_token_type_ids=False, verbose=False)["input_ids"]
        tail = [] if self.eos is None else [self.eos]
        # int32 arrays, not lists of Python ints (~9x smaller) while the writer buffers the batch
        return {"input_ids": [np.asarray(x + tail, dtype=np.int32) for x in ids]}


def _tokenizer_fingerprint(tokenizer) -> str | None:
    """A stable hash of what the tokenizer does (None: let `datasets` hash the function)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    # to_str() holds the vocabulary, merges, normalizer, pre-tokenizer and post-processor
    return backend.to_str() + json.dumps(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()))


def _fingerprint(*parts) -> str:
    from datasets.fingerprint import Hasher

    return Hasher.hash((_FORMAT_VERSION,) + parts)


def tokenize_documents(ds, tokenizer, text_column: str = "text", num_proc: int | None = None,
                       load_from_cache_file: bool = True, batch_size: int = 100):
    """``.map`` the documents to ``input_ids`` (tokens + EOS; empty documents skipped), cached for map-style data."""
    import datasets

    _, eos = special_token_ids(tokenizer)
    fn = _Tokenize(tokenizer, text_column, eos)
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    if isinstance(ds, datasets.IterableDataset):
        return ds.map(fn, batched=True, batch_size=batch_size, remove_columns=ds.column_names or [text_column],
                      features=features)
    kwargs = {}
    token_hash = _tokenizer_fingerprint(tokenizer)
    if token_hash is not None:
        kwargs["new_fingerprint"] = _fingerprint("tokenize", ds._fingerprint, token_hash, text_column, eos)
    # memory is bounded by one batch of documents: writer_batch_size flushes each batch to disk
    return ds.map(fn, batched=True, batch_size=batch_size, writer_batch_size=batch_size, num_proc=num_proc,
                  remove_columns=ds.column_names, features=features, load_from_cache_file=load_from_cache_file,
                  desc="tokenizing", **kwargs)


class _TokenStream:
    """The ``input_ids`` of a map-style dataset read as one flat token stream, zero-copy from its Arrow chunks.

    Picklable (``num_proc`` workers open their own view of the memory-mapped files)."""

    def __init__(self, tokenized):
        self.tokenized = tokenized
        self._chunks = None

    def __getstate__(self):
        return {"tokenized": self.tokenized, "_chunks": None}

    def _load(self):
        import numpy as np

        column = self.tokenized.data.column("input_ids")
        self._chunks = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
        self._starts = np.cumsum([0] + [len(c) for c in self._chunks])

    def read(self, start: int, stop: int):
        """Tokens ``[start, stop)`` of the stream as one numpy array."""
        import numpy as np

        if self._chunks is None:
            self._load()
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            chunk, offset = self._chunks[first], int(self._starts[first])
            take = chunk[start - offset : min(stop - offset, len(chunk))]
            pieces.append(take)
            start += len(take)
            first += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class _PackGlobal:
    """Batched map over tokenized documents (with indices): the blocks whose body *starts* inside the batch.

    Block ``k`` holds stream tokens ``[k * body, (k + 1) * body)``; it may reach into later documents,
    which the token stream reads. Every full body of the stream is emitted exactly once."""

    def __init__(self, tokenized, document_starts, body: int, bos: int, num_blocks: int):
        self.stream = _TokenStream(tokenized)
        self.document_starts, self.body, self.bos, self.num_blocks = document_starts, body, bos, num_blocks

    def __call__(self, batch, indices):
        import numpy as np
        import pyarrow as pa

        lo, hi = self.document_starts[indices[0]], self.document_starts[indices[-1] + 1]
        first, last = -(-lo // self.body), min(-(-hi // self.body), self.num_blocks)  # blocks with start in [lo, hi)
        count = max(0, last - first)  # 0: the batch lies inside one block, or in the dropped tail
        if count == 0:
            return pa.table({"input_ids": pa.array([], type=pa.list_(pa.int32()))})
        bodies = self.stream.read(first * self.body, (first + count) * self.body).reshape(count, self.body)
        blocks = np.concatenate([np.full((count, 1), self.bos, dtype=np.int32), bodies.astype(np.int32)], axis=1)
        offsets = pa.array(np.arange(count + 1, dtype=np.int32) * (self.body + 1))
        return pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(blocks.reshape(-1)))})


class _PackStream:
    """Batched map over a *stream* of tokenized documents: cut bodies, carry the rest into the next batch.

    The carry restarts with every pass over the stream (the running index is 0 again)."""

    def __init__(self, body: int, bos: int):
        self.body, self.bos = body, bos
        self.carry = None

    def __call__(self, batch, indices):
        import numpy as np

        if indices[0] == 0 or self.carry is None:
            self.carry = np.zeros(0, dtype=np.int32)
        stream = np.concatenate([self.carry] + [np.asarray(ids, dtype=np.int32) for ids in batch["input_ids"]])
        full = len(stream) // self.body
        self.carry = stream[full * self.body :]
        bodies = stream[: full * self.body].reshape(full, self.body)
        return {"input_ids": list(np.concatenate([np.full((full, 1), self.bos, dtype=np.int32), bodies], axis=1))}


def pack_blocks(tokenized, tokenizer, block_size: int, num_proc: int | None = None,
                load_from_cache_file: bool = True, batch_size: int = 100):
    """Pack tokenized documents into BOS-prefixed blocks of ``block_size``.

    Map-style: returns ``(blocks, PackingStats)``; only the end of the whole stream is dropped.
    Streaming: returns ``(blocks, None)``; the counts are not known before the stream is read.
    """
    import datasets
    import numpy as np
    import pyarrow.compute as pc

    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (BOS + at least one token), got {block_size}")
    bos, _ = special_token_ids(tokenizer)
    body = block_size - 1
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    if isinstance(tokenized, datasets.IterableDataset):
        blocks = tokenized.map(_PackStream(body, bos), batched=True, batch_size=batch_size, with_indices=True,
                               remove_columns=["input_ids"], features=features)
        return blocks, None

    if tokenized._indices is not None:
        tokenized = tokenized.flatten_indices()
    lengths = pc.list_value_length(tokenized.data.column("input_ids")).to_numpy(zero_copy_only=False)
    document_starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    total = int(document_starts[-1])
    num_blocks = total // body
    stats = PackingStats(documents=len(tokenized), tokens=total, blocks=num_blocks, block_size=block_size,
                         dropped_tokens=total - num_blocks * body)
    if num_blocks == 0:
        raise ValueError(
            f"the data holds {total} tokens, fewer than one block of {block_size}: give more text or a smaller --block_size"
        )
    fn = _PackGlobal(tokenized, document_starts, body, bos, num_blocks)
    blocks = tokenized.with_format("arrow").map(
        fn, batched=True, batch_size=batch_size, with_indices=True, num_proc=num_proc, remove_columns=["input_ids"],
        features=features, load_from_cache_file=load_from_cache_file, desc=f"packing into blocks of {block_size}",
        new_fingerprint=_fingerprint("pack", tokenized._fingerprint, block_size, bos),
    ).with_format(None)
    if len(blocks) != num_blocks:  # a broken invariant, not bad input
        raise RuntimeError(f"packing made {len(blocks)} blocks, expected {num_blocks}")
    return blocks, stats


def build_blocks(ds, tokenizer, block_size: int, text_column: str = "text", num_proc: int | None = None,
                 load_from_cache_file: bool = True, what: str = "training data", batch_size: int = 100,
                 log: bool = True):
    """Tokenize and pack a text dataset (map-style or streaming). Returns ``(blocks, PackingStats | None)``.

    ``batch_size``: documents per ``.map`` batch (memory per worker); the blocks do not depend on it.
    ``log``: log the summary (False on all but the main process of a multi-process run)."""
    import datasets

    cache_files = getattr(ds, "cache_files", None)
    with disk_full_is_one_line(str(Path(cache_files[0]["filename"]).parent) if cache_files else None):
        tokenized = tokenize_documents(ds, tokenizer, text_column, num_proc=num_proc,
                                       load_from_cache_file=load_from_cache_file, batch_size=batch_size)
        if isinstance(tokenized, datasets.Dataset) and len(tokenized) == 0:
            raise ValueError(f"no text found in the {what}: every document is empty (field {text_column!r})")
        blocks, stats = pack_blocks(tokenized, tokenizer, block_size, num_proc=num_proc,
                                    load_from_cache_file=load_from_cache_file, batch_size=batch_size)
    if log and stats is not None:
        logger.info("%s: %s", what, stats.describe())
    elif log:
        logger.info("%s (streaming): packed on the fly into blocks of %d; each pass over the stream drops its "
                    "last < %d tokens per data-loader worker", what, block_size, block_size - 1)
    return blocks, stats


def split_for_rank(ds, rank: int, world_size: int):
    """This rank's part of a dataset: ``datasets.distributed.split_dataset_by_node``.

    A stream with a number of shards (files) divisible by ``world_size`` is split by shards (each rank
    reads only its own files); otherwise each rank reads the stream and keeps every ``world_size``-th
    block. Either way the ranks' blocks are disjoint."""
    from datasets.distributed import split_dataset_by_node

    if world_size <= 1:
        return ds
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} processes")
    return split_dataset_by_node(ds, rank=rank, world_size=world_size)


def is_split_by_node(ds) -> bool:
    """Whether ``ds`` is a stream that :func:`split_for_rank` already gave one rank's part of."""
    # datasets records the split in `_distributed` (a DistributedConfig); there is no public accessor
    return getattr(ds, "_distributed", None) is not None


@contextmanager
def rank_local_prepare(accelerator):
    """Within this block, ``accelerator.prepare(dataloader)`` places batches on the device but does not split.

    accelerate assumes a data loader sees the whole data set and cuts it again per process (a
    ``datasets.IterableDataset`` by ``.shard()``, any other stream by ``IterableDatasetShard``): on a
    stream already split with ``split_dataset_by_node`` every rank would keep only a part of its part
    (accelerate has no switch for this yet: huggingface/accelerate#4276)."""
    from accelerate.data_loader import prepare_data_loader

    def prepare(dataloader):
        return prepare_data_loader(dataloader, accelerator.device, num_processes=1, process_index=0,
                                   put_on_device=accelerator.device_placement, dispatch_batches=False,
                                   non_blocking=accelerator.non_blocking)

    accelerator.prepare = prepare
    try:
        yield
    finally:
        del accelerator.prepare


def chunk_into_blocks(texts: Iterable[str], tokenizer, block_size: int, batch_size: int = 1000):
    """Blocks from documents held in memory (small inputs: the demo, tests): :func:`build_blocks` on them.

    Returns a ``datasets.Dataset`` with one column, ``input_ids``; only the end of the stream is dropped."""
    import datasets

    ds = datasets.Dataset.from_dict({"text": list(texts)})
    if len(ds) == 0:
        raise ValueError("no text to chunk into blocks: the input is empty")
    # in-memory text is small: no progress bars (the demo's --quiet stays quiet)
    were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        blocks, _ = build_blocks(ds, tokenizer, block_size, what="text")
    finally:
        if not were_disabled:
            datasets.enable_progress_bars()
    return blocks
