"""Reading and writing the small JSON and text files of a checkpoint folder.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# the lock, the final marker and what an unfinished run is live in the bundle, where from_pretrained checks them
from ..models.lookaround.loading_lookaround import FINAL_MARKER, LOCK_FILE, unfinished_run  # noqa: F401


def read_json(path: Path) -> Any | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        logger.warning("ignoring %s: not valid JSON (%s)", path, err)
        return None


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



def write_text(path: Path, text: str) -> None:
    # unlink first: in a staging folder the old file is a symlink into the user's checkpoint
    if path.is_symlink():
        path.unlink()
    path.write_text(text, encoding="utf-8")
