"""The one reader of local data files: every record is checked here, naming file and line, before any library
(``datasets``/Arrow, ``tokenizers``, ``json``'s recursion) sees it.

What a data file may hold, by kind:

- ``.txt`` (``.gz``): one document, UTF-8;
- ``.jsonl`` / ``.json`` (``.gz``): one JSON object per line (or a ``.json`` file holding one array of objects);
  with a ``text_column``, each object's field of that name is the document and must be a string;
- ``.csv`` (``.gz``): UTF-8 lines (the ``csv`` builder parses them);
- ``.parquet``: a readable file; with a ``text_column``, a string column of that name.

What is refused, in one line: a gzip stream cut short or damaged, a byte that is not UTF-8, a line that is not
JSON, a record nested deeper than :data:`MAX_DEPTH` (checked by a bounded scan *before* parsing: a record of
100,000 nested brackets overflows the C stack of Arrow's reader and Python's recursion), a record that is not
an object, and a document that is not a string (a list or an object is never stringified). A record whose
document is missing or null is reported with the others of its file (line numbers and count).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator
from typing import Any
from pathlib import Path

__all__ = ["MAX_DEPTH", "check_file", "read_documents", "read_lines", "read_records", "is_devnull"]

# the deepest JSON nesting a record may have: a text record is depth 1, a labelled one a few levels more
MAX_DEPTH = 64
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _kind(path: Path) -> str:
    name = path.name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return name.rsplit(".", 1)[-1] if "." in name else ""


def is_devnull(path) -> bool:
    try:
        return os.path.samefile(path, os.devnull)
    except OSError:
        return False


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _not_utf8(path: Path, lineno: int, err: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{path}:{lineno}: not UTF-8 text ({err.reason}, byte {err.object[err.start:err.start + 1]!r}): "
                      "convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`")


def _damaged(path: Path, lineno: int, err: Exception) -> ValueError:
    what = "the gzip stream is cut short or damaged" if path.name.lower().endswith(".gz") else "it cannot be read"
    return ValueError(f"{path}: {what} after line {lineno} ({type(err).__name__}: {err}); fix or remove the file")


def read_lines(path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of ``path``, decoded as UTF-8; a gzip stream cut short, an unreadable
    file or a byte that is not UTF-8 raises ValueError naming the file (and the line)."""
    path = Path(path)
    lineno = 0
    try:
        with _open_bytes(path) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise _not_utf8(path, lineno, err) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise _damaged(path, lineno, err) from None
    except IsADirectoryError:
        raise
    except OSError as err:
        if err.filename is None:  # a read error inside the stream, not a missing file
            raise _damaged(path, lineno, err) from None
        raise


def _read_text(path: Path) -> str:
    """The whole of a ``.txt`` file, with universal newlines (as ``open(..., "rt")`` reads it)."""
    text = "".join(line for _, line in read_lines(path))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _too_deep(text: str) -> bool:
    """Whether ``text`` nests JSON deeper than MAX_DEPTH. Counting brackets is a bound that costs nothing on
    ordinary records; only past it are the brackets outside strings followed."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    depth = 0
    for bracket in _BRACKETS.finditer(_STRING.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        if depth > MAX_DEPTH:
            return True
    return False


def _parse(path: Path, where: str, text: str):
    if _too_deep(text):
        raise ValueError(f"{path}:{where}: a record nested deeper than {MAX_DEPTH} levels of brackets: a data record "
                         "holds one document (a JSON object with a text field); fix or remove it")
    try:
        return json.loads(text)
    except ValueError as err:
        column = f" at column {err.colno}" if hasattr(err, "colno") else ""
        raise ValueError(f"{path}:{where}: not a JSON record ({getattr(err, 'msg', err)}{column}): the line is cut short or "
                         "malformed; fix or remove it") from None


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def read_records(path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of each JSON object of a ``.jsonl``/``.json`` file (``where``: ``"3"`` for line 3, or
    ``"record 3"`` of a JSON array); every check of this module's docstring but the text field's."""
    path = Path(path)
    lines = read_lines(path)
    for lineno, line in lines:
        if not line.strip():
            continue
        if _kind(path) == "json" and line.lstrip().startswith("[") and not line.rstrip().endswith("}"):
            # a .json array (over one line or many): parsed whole, numbered by record
            text = line + "".join(rest for _, rest in lines)
            records = _parse(path, f"{lineno}", text)
            if not isinstance(records, list):
                raise ValueError(f"{path}: not a JSON array of records nor JSON Lines; fix the file")
            for number, record in enumerate(records, 1):
                yield f"record {number}", _object(path, f"record {number}", record)
            return
        yield str(lineno), _object(path, str(lineno), _parse(path, str(lineno), line))


def _object(path: Path, where: str, record):
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{where}: a record must be a JSON object (e.g. {{\"text\": \"...\"}}), not "
                         f"{_type_name(record)}; fix or remove it")
    return record


def read_documents(path, text_column: str = "text", shown: int = 5) -> Iterator[str]:
    """The documents of one data file, in order (empty ones included), every record checked. Records without a
    ``text_column`` string (absent or null) are counted and refused together once the file is read."""
    path = Path(path)
    kind = _kind(path)
    if kind == "txt":
        yield _read_text(path)
        return
    if kind == "parquet":
        yield from _parquet_documents(path, text_column)
        return
    missing, fields, count = [], None, 0
    for where, record in read_records(path):
        count += 1
        text = record.get(text_column)
        if text is None:
            missing.append(where)
            fields = fields or sorted(record)
            continue
        if not isinstance(text, str):
            raise ValueError(f"{path}:{where}: field {text_column!r} holds {_type_name(text)}, not a string: each "
                             "record holds its document as one string; fix the record or set --text_column")
        yield text
    if missing and len(missing) == count:
        raise ValueError(f"{path}: no field {text_column!r} (fields: {fields}); set --text_column")
    if missing:
        noun = "record" if missing[0].startswith("record") else "line"
        numbers = [w.split()[-1] for w in missing]
        raise ValueError(
            f"{path}: {len(missing)} record(s) hold no {text_column!r} text ({noun}s "
            f"{', '.join(numbers[:shown])}{', ...' if len(numbers) > shown else ''}): every record must hold its "
            f"document in {text_column!r}; fix or remove them, or set --text_column")


def _parquet_documents(path: Path, text_column: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise ValueError(f"{path}: not a readable parquet file ({err}); fix or remove it") from None
    schema = parquet.schema_arrow
    if text_column not in schema.names:
        raise ValueError(f"{path}: no field {text_column!r} (fields: {schema.names}); set --text_column")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: column {text_column!r} holds {kind}, not strings: each row holds its document as "
                         "one string; set --text_column")
    try:
        for batch in parquet.iter_batches(columns=[text_column]):
            yield from batch.column(0).to_pylist()
    except OSError as err:
        raise ValueError(f"{path}: not a readable parquet file ({err}); fix or remove it") from None


def check_file(path, text_column: str | None = "text") -> int:
    """Read ``path`` through the checks and return how many records (documents) it holds (0: an empty file).

    ``text_column`` None: the records of a labelled data set (objects, any fields); ``.csv``: UTF-8 lines."""
    path = Path(path)
    if is_devnull(path):
        return 0
    kind = _kind(path)
    if kind == "csv":
        return sum(1 for _, line in read_lines(path) if line.strip())
    if text_column is None and kind in ("json", "jsonl"):
        return sum(1 for _ in read_records(path))
    if kind == "txt":
        return int(bool(_read_text(path)))
    return sum(1 for _ in read_documents(path, text_column))


def load_json_file(path) -> Any:
    """The JSON of ``path``; a file cut short or damaged raises one line that names it (``json`` names no file)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason}): the file is damaged; write it again") from None
    except ValueError as err:
        where = f" at line {err.lineno} column {err.colno}" if hasattr(err, "lineno") else ""
        raise ValueError(f"{path}: not valid JSON ({getattr(err, 'msg', err)}{where}): the file is cut short or "
                         "damaged; write it again (or remove it)") from None
