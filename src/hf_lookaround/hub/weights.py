"""Check a checkpoint's weights files before anything loads or pushes them: present, listed in the index,
valid safetensors (:func:`check_weights`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .files import read_json

logger = logging.getLogger(__name__)

WEIGHTS_NAME, WEIGHTS_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"


def _check_safetensors(path: Path, where: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = list(f.keys())
    except Exception as err:  # safetensors raises its own error type; name the file instead
        raise ValueError(
            f"{path.name} in {where} is not a valid safetensors file ({err}); it is truncated or corrupt. "
            f"Save the model again with save_pretrained and re-upload it (hf-lookaround push <dir> <repo>)."
        ) from None
    if not keys:
        raise ValueError(f"{path.name} in {where} holds no tensors; save the model again and re-upload it")


def check_weights(folder, where: str | None = None) -> list[Path]:
    """Check that ``folder`` holds safetensors weights (one file or an index and its shards) with valid headers.

    Returns the weight files; raises ValueError naming the missing or corrupt file otherwise.
    """
    from ..training.checkpointing import unfinished_run

    folder = Path(folder)
    where = where or str(folder)
    if unfinished_run(folder):
        raise ValueError(unfinished_run(folder))
    index = folder / WEIGHTS_INDEX_NAME
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif index.is_file():
        data = read_json(index)
        if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
            raise ValueError(f"{WEIGHTS_INDEX_NAME} in {where} is not a valid index (no weight_map); save the model again")
        files = [folder / name for name in sorted(set(data["weight_map"].values()))]
        for path in files:
            if not path.is_file():
                raise ValueError(f"{path.name}, listed in {WEIGHTS_INDEX_NAME}, is missing from {where}; upload it")
    else:
        pickled = [p.name for p in folder.glob("*.bin")]
        hint = (f" (found {', '.join(pickled)}: re-save with save_pretrained, which writes safetensors)"
                if pickled else "")
        raise ValueError(f"no weights in {where}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}{hint}")
    for path in files:
        _check_safetensors(path, where)
    return files


def check_local_weights(model_name_or_path) -> None:
    """For a local checkpoint folder, :func:`check_weights` before ``from_pretrained``, which names no file when
    ``model.safetensors`` is cut short; a Hub name is left to ``from_pretrained`` (see ``load.load_pretrained``)."""
    if Path(model_name_or_path).is_dir():
        check_weights(model_name_or_path)
