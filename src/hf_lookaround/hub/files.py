"""Reading and writing the small JSON and text files of a checkpoint folder.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# written by a pretrain run into its output_dir: the lock while it runs, the final model's marker last
# (training/checkpointing.py writes both; hub/weights.py reads them before loading)
LOCK_FILE = ".hf_lookaround.lock"
FINAL_MARKER = "final_model_complete.json"


def unfinished_run(folder) -> str | None:
    """Why ``folder`` must not be loaded as a model yet (None: it may): the ``output_dir`` of a ``pretrain`` run
    still writing its final model, or killed before it ended (its lock is there, and :data:`FINAL_MARKER`, written
    last, is not). Its weights may be there without the card or every head's ``auto_map``."""
    root = Path(folder)
    if (root / LOCK_FILE).is_file() and not (root / FINAL_MARKER).is_file():
        return (f"{root} is the output_dir of a pretrain run that has not finished ({LOCK_FILE} is there, and "
                f"{FINAL_MARKER}, written last, is not): wait for the run to end (or resume a killed one with "
                "--resume_from_checkpoint last), or load one of its complete checkpoint-N folders")
    return None


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
