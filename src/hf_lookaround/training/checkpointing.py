"""Checkpoints that are atomic from the reader's view, and the checks made before resuming.

``Trainer`` writes ``checkpoint-N/`` file by file (weights, optimizer, scheduler, one RNG state per
process, ``trainer_state.json``). A process killed part-way leaves a folder that looks like a
checkpoint but cannot be resumed from. Here a checkpoint counts as *complete* only once it holds
:data:`COMPLETE_MARKER`, which the saving process writes last: after every process has finished
writing (a barrier), after every file and the folder were fsync'd, through a temporary file that
is renamed into place (a rename is atomic on POSIX file systems). Readers (``last`` resume,
``save_total_limit`` rotation) only ever look at complete checkpoints:

- :func:`last_complete_checkpoint` is the newest complete ``checkpoint-N`` of a folder;
- :func:`rotate_complete_checkpoints` deletes the oldest complete checkpoints beyond the limit, and
  runs only after the new checkpoint is complete, so a kill never leaves fewer complete ones;
- :func:`remove_incomplete_checkpoints` moves the debris of a killed save aside (main process, at start);
- :func:`resolve_resume_checkpoint` turns ``--resume_from_checkpoint last|DIR`` into a folder, with a
  clear error for an incomplete one;
- :func:`check_resume_compatible` refuses a checkpoint of another objective or model size.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)

__all__ = [
    "COMPLETE_MARKER",
    "is_complete",
    "list_checkpoints",
    "complete_checkpoints",
    "last_complete_checkpoint",
    "mark_complete",
    "rotate_complete_checkpoints",
    "remove_incomplete_checkpoints",
    "resolve_resume_checkpoint",
    "check_resume_compatible",
    "allow_indexed_cpu_map_location",
]

COMPLETE_MARKER = "checkpoint_complete.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

# config fields that must agree between a checkpoint and the run resuming from it
RESUME_FIELDS = (
    "objective", "plan_params", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "max_position_embeddings", "hidden_act", "norm_type", "norm_position",
    "position_embedding_type",
)


def is_complete(folder) -> bool:
    return (Path(folder) / COMPLETE_MARKER).is_file()


def list_checkpoints(output_dir) -> list[Path]:
    """Every ``checkpoint-N`` folder of ``output_dir``, by step (oldest first)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def complete_checkpoints(output_dir) -> list[Path]:
    return [p for p in list_checkpoints(output_dir) if is_complete(p)]


def last_complete_checkpoint(output_dir) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_complete(folder, global_step: int, world_size: int) -> None:
    """fsync every file of ``folder`` and the folder, then write the marker atomically.

    Call it on the process that saves, after all processes have finished writing into ``folder``."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)
    for path in files:
        _fsync(path)
    for sub in sorted({p.parent for p in files} | {folder}):
        _fsync(sub, directory=True)
    manifest = {
        "global_step": int(global_step),
        "world_size": int(world_size),
        "files": {str(p.relative_to(folder)): p.stat().st_size for p in files},
    }
    tmp = folder / (COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / COMPLETE_MARKER)  # atomic: the marker is there in full or not at all
    _fsync(folder, directory=True)


def rotate_complete_checkpoints(output_dir, save_total_limit: int | None, keep=()) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``save_total_limit`` (the newest and ``keep`` stay).

    Incomplete folders are never counted: a broken save cannot push out a good checkpoint."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    done = complete_checkpoints(output_dir)
    protected = {done[-1].resolve()} if done else set()
    protected |= {Path(k).resolve() for k in keep if k}
    deleted = []
    excess = len(done) - max(save_total_limit, len(protected))
    for path in done:
        if excess <= 0:
            break
        if path.resolve() not in protected:
            logger.info("deleting checkpoint %s (save_total_limit=%d)", path, save_total_limit)
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
            excess -= 1
    return deleted


def remove_incomplete_checkpoints(output_dir) -> list[Path]:
    """Move ``checkpoint-N`` folders without the marker aside, to ``incomplete-checkpoint-N``.

    They are what a kill during a save leaves behind, or checkpoints written without the marker (by plain
    ``Trainer``): nothing is deleted, but no reader (resume, rotation, a new save of step N) sees them again.
    Returns the new paths."""
    moved = []
    for path in list_checkpoints(output_dir):
        if not is_complete(path):
            target = path.with_name(f"incomplete-{path.name}")
            suffix = 1
            while target.exists():
                target = path.with_name(f"incomplete-{path.name}-{suffix}")
                suffix += 1
            logger.warning("%s is incomplete (a save that did not finish, or no %s): moved aside to %s",
                           path, COMPLETE_MARKER, target)
            os.replace(path, target)
            moved.append(target)
    return moved


def resolve_resume_checkpoint(resume_from_checkpoint, output_dir) -> str | None:
    """``--resume_from_checkpoint`` as a folder: ``last``/``true`` is the newest complete checkpoint of
    ``output_dir``; an explicit folder must be a complete checkpoint."""
    if resume_from_checkpoint in (None, "", False, "False", "false"):
        return None
    if resume_from_checkpoint in (True, "last", "True", "true"):
        found = last_complete_checkpoint(output_dir)
        if found is None:
            incomplete = list_checkpoints(output_dir)
            raise ValueError(
                f"--resume_from_checkpoint last: no complete checkpoint in {output_dir}"
                + (f" (only incomplete ones: {[p.name for p in incomplete]})" if incomplete else "")
                + "; start without --resume_from_checkpoint, or name a complete checkpoint folder"
            )
        logger.info("resuming from %s, the newest complete checkpoint", found)
        return str(found)
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise ValueError(f"--resume_from_checkpoint {path}: no such folder")
    if not is_complete(path):
        done = last_complete_checkpoint(path.parent)
        raise ValueError(
            f"--resume_from_checkpoint {path} is not a complete checkpoint (no {COMPLETE_MARKER}: its save was "
            "interrupted, or it was not written by hf-lookaround)"
            + (f"; the newest complete one in that folder is {done}" if done else "")
            + "; pass a complete checkpoint, or `last`"
        )
    return str(path)


def check_resume_compatible(checkpoint, config, world_size: int | None = None) -> None:
    """Raise if ``checkpoint``'s config.json has another objective, plan or model size than ``config``;
    warn if it was saved by another number of processes (the run goes on, but not exactly as it would have)."""
    marker = Path(checkpoint) / COMPLETE_MARKER
    if world_size is not None and marker.is_file():
        saved_world = json.loads(marker.read_text()).get("world_size")
        if saved_world is not None and saved_world != world_size:
            logger.warning(
                "resuming from %s, saved by %d process(es), with %d: the data order and the per-rank plans "
                "differ from those of the interrupted run, so the resumed run is not an exact continuation",
                checkpoint, saved_world, world_size,
            )
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise ValueError(f"--resume_from_checkpoint {checkpoint}: the checkpoint has no config.json")
    saved = json.loads(path.read_text())
    current = config.to_dict()
    diffs = []
    for key in RESUME_FIELDS:
        if key in saved or key in current:
            a, b = saved.get(key), current.get(key)
            if _normalise(a) != _normalise(b):
                diffs.append(f"{key}: checkpoint {a!r}, this run {b!r}")
    if diffs:
        raise ValueError(
            f"cannot resume from {checkpoint}: it was trained with another objective or model size ("
            + "; ".join(diffs)
            + "). Resume with the arguments of that run, or start a new run from its weights with "
            "--model_name_or_path (without --resume_from_checkpoint)"
        )


def _normalise(value):
    # JSON turns tuples into lists
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    return value


_CPU_INDEX_REGISTERED = False


def allow_indexed_cpu_map_location() -> None:
    """Let ``torch.load(..., map_location="cpu:N")`` work.

    In a multi-process CPU run (gloo) ``TrainingArguments.device`` is ``cpu:0``, and ``Trainer`` loads the
    optimizer state of a checkpoint with ``map_location=args.device``; torch's default deserialisers know
    ``cpu`` but not ``cpu:0``, so resuming failed. A ``cpu:N`` location is the CPU: keep the storage."""
    global _CPU_INDEX_REGISTERED
    if _CPU_INDEX_REGISTERED:
        return
    import torch

    def restore(storage, location):
        return storage if location.startswith("cpu:") else None

    # a priority of its own (entries are sorted as tuples: equal priorities would compare functions)
    taken = {entry[0] for entry in getattr(torch.serialization, "_package_registry", [])}
    torch.serialization.register_package(max(taken, default=0) + 1, lambda obj: None, restore)
    _CPU_INDEX_REGISTERED = True
