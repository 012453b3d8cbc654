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
from ..data.records import load_json_file  # noqa: F401  (the reader of every JSON file a run reads)


def read_json(path: Path) -> Any | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        logger.warning("ignoring %s: not valid JSON (%s)", path, err)
        return None


def write_text(path: Path, text: str) -> None:
    # unlink first: in a staging folder the old file is a symlink into the user's checkpoint
    if path.is_symlink():
        path.unlink()
    path.write_text(text, encoding="utf-8")
