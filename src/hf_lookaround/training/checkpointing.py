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
- :func:`check_resume_compatible` refuses a checkpoint of another objective or model size;
- :func:`missing_training_state` names what a checkpoint cannot restore besides its weights (optimizer,
  schedule, RNG state, trainer state: a ``--save_only_model`` checkpoint, or files deleted with their marker
  entries); a resume refuses such a checkpoint unless ``--resume_weights_only true`` asks for its weights alone;
- :func:`checkpoint_problems` checks a complete checkpoint against its marker (every listed file there, with
  its size, a sample of its bytes and the sha256 of the whole file): a file deleted, cut short, rewritten or
  corrupted anywhere after the marker is found, and
  ``last`` skips such a checkpoint with a warning (a named one is refused);
- :func:`set_aside_later_checkpoints` moves the checkpoints after the one a run resumes from (and damaged
  ones) aside, so that no save of the resumed run ever writes into a folder that holds an old marker;
- :func:`mark_final_model` records the final model of ``output_dir`` as a marker records a checkpoint, and
  :func:`final_model_problems` checks it: a finished run rerun with ``last`` rewrites a damaged final model from
  its last checkpoint instead of keeping it;
- :func:`decide_resume` puts these together for a ``pretrain`` run: the checkpoint it goes on from, and whether
  it trains, only writes its final model again, or has nothing left to do;
- :func:`check_output_dir` refuses to start a new run in an occupied folder, and :class:`OutputDirLock` a
  second run writing the same folder at once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

# the final marker, the lock and what an unfinished run is: from the bundle, where from_pretrained checks them too
from ..models.lookaround.loading_lookaround import FINAL_MARKER, LOCK_FILE, safetensors_problem, unfinished_run  # noqa: F401

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
    "missing_training_state",
    "allow_indexed_cpu_map_location",
    "checkpoint_problems",
    "set_aside_later_checkpoints",
    "check_output_dir",
    "FINAL_MARKER",
    "final_model_files",
    "mark_final_model",
    "final_model_problems",
    "OutputDirLock",
    "LOCK_FILE",
    "save_failure_is_one_line",
    "unsafe_pickle_is_one_line",
]

COMPLETE_MARKER = "checkpoint_complete.json"
# an empty or unreadable lock older than this is no run's (a run writes its record right after creating the file)
STALE_UNREADABLE_LOCK_S = 10.0
_SAMPLE = 1 << 16  # bytes read at the start, middle and end of a file for its sample digest
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

# config fields that must agree between a checkpoint and the run resuming from it
RESUME_FIELDS = (
    "objective", "plan_params", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "max_position_embeddings", "hidden_act", "norm_type", "norm_position",
    "position_embedding_type", "prediction_stream",  # the stream trained to predict: --ar_form / --masked_form
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


def _sample_digest(path: Path, size: int) -> str:
    """sha256 of the size and of 64 KiB at the start, middle and end: cheap for any size, and other bytes
    of the same size (new weights of the same model beside an old marker) give another digest."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(offset)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    """sha256 of the whole file: a byte changed anywhere is found, which the sample digest misses outside its three
    windows. About 0.8 s per GB on one core (measured: a 1 GiB file from the page cache, hashlib/OpenSSL); a resume
    reads those weights anyway."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_problems(folder) -> list[str]:
    """What is wrong with ``folder`` as a checkpoint, one short phrase per problem (empty: intact).

    Every file the marker lists must be there with its size and, for markers that record them, the same sample
    digest and the same sha256 of the whole file: a file rewritten or corrupted after the marker was written is found
    even at the same size, wherever the changed bytes are."""
    folder = Path(folder)
    if not (folder / COMPLETE_MARKER).is_file():
        return [f"no {COMPLETE_MARKER}"]
    return _listed_problems(folder, COMPLETE_MARKER)


def _listed_problems(folder: Path, marker_name: str) -> list[str]:
    """The files that ``folder/marker_name`` lists, checked: each there, with its size and sample digest."""
    marker = folder / marker_name
    try:
        manifest = json.loads(marker.read_text())
        files, samples, digests = manifest["files"], manifest.get("samples", {}), manifest.get("sha256", {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"unreadable {marker_name} ({type(err).__name__})"]
    problems = []
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} missing")
            continue
        actual = path.stat().st_size
        if actual != size:
            problems.append(f"{name} has {actual} bytes, the marker says {size}")
        elif name in samples and _sample_digest(path, actual) != samples[name]:
            problems.append(f"{name} changed after the marker was written")
        elif name in digests and _file_sha256(path) != digests[name]:  # markers written before it lack it
            problems.append(f"{name} changed after the marker was written (its sha256 differs)")
    return problems


def _intact_or_warn(folder: Path) -> bool:
    problems = checkpoint_problems(folder)
    if problems:
        logger.warning("skipping %s: damaged (%s)", folder, "; ".join(problems))
    return not problems


def _set_aside(path: Path, prefix: str) -> Path:
    target = path.with_name(f"{prefix}-{path.name}")
    suffix = 1
    while target.exists():
        target = path.with_name(f"{prefix}-{path.name}-{suffix}")
        suffix += 1
    os.replace(path, target)
    return target


def set_aside_later_checkpoints(output_dir, checkpoint) -> list[Path]:
    """Before a run resumes from ``checkpoint``, move aside every ``checkpoint-N`` of ``output_dir`` after it
    (``superseded-checkpoint-N``, or ``damaged-checkpoint-N`` for one that fails :func:`checkpoint_problems`).

    They belong to a future this run replaces: left in place, the run's own save of step N would write into
    a folder holding the old marker, and ``last`` could pick them after a kill. Nothing is deleted."""
    moved = []
    if checkpoint is None or Path(checkpoint).resolve().parent != Path(output_dir).resolve():
        return moved
    step = int(_CHECKPOINT_RE.match(Path(checkpoint).name).group(1))
    for path in list_checkpoints(output_dir):
        if int(_CHECKPOINT_RE.match(path.name).group(1)) > step:
            prefix = "damaged" if checkpoint_problems(path) else "superseded"
            target = _set_aside(path, prefix)
            logger.warning("resuming from %s: moved the later %s aside to %s", checkpoint, path.name, target.name)
            moved.append(target)
    return moved


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_complete(folder, global_step: int, world_size: int, run: dict | None = None) -> None:
    """fsync every file of ``folder`` and the folder, then write the marker atomically.

    ``run``: the settings a resume must share that no other file of the checkpoint holds (``block_size``).
    Call it on the process that saves, after all processes have finished writing into ``folder``."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)
    _write_marker(folder, files, COMPLETE_MARKER, global_step=int(global_step), world_size=int(world_size),
                  **({"run": dict(run)} if run else {}))


def _write_marker(folder: Path, files: list[Path], marker_name: str, **fields) -> None:
    """fsync ``files`` and their folders, then write ``folder/marker_name`` (their sizes and sample digests) atomically."""
    for path in files:
        _fsync(path)
    for sub in sorted({p.parent for p in files} | {folder}):
        _fsync(sub, directory=True)
    manifest = {
        **{k: v for k, v in fields.items() if k != "run"},
        "files": {str(p.relative_to(folder)): p.stat().st_size for p in files},
        "samples": {str(p.relative_to(folder)): _sample_digest(p, p.stat().st_size) for p in files},
        "sha256": {str(p.relative_to(folder)): _file_sha256(p) for p in files},
        **({"run": fields["run"]} if "run" in fields else {}),
    }
    tmp = folder / (marker_name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / marker_name)  # atomic: the marker is there in full or not at all
    _fsync(folder, directory=True)


# ---------------------------------------------------------------------------------------------
# the final model of output_dir, checked as checkpoints are
# ---------------------------------------------------------------------------------------------
_FINAL_MODEL_FILES = ("config.json", "generation_config.json", "trainer_state.json", "model*.safetensors",
                      "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def final_model_files(output_dir) -> list[Path]:
    """The files of the final model saved at the top of ``output_dir`` (weights, config, trainer state)."""
    root = Path(output_dir)
    return sorted({p for pattern in _FINAL_MODEL_FILES for p in root.glob(pattern) if p.is_file()})


def mark_final_model(output_dir, global_step: int) -> None:
    """After the final ``save_model`` and ``save_state``: record the final model's files as a checkpoint's marker
    does, so that a rerun can tell a damaged final model (:func:`final_model_problems`)."""
    _write_marker(Path(output_dir), final_model_files(output_dir), FINAL_MARKER, global_step=int(global_step))


def final_model_problems(output_dir) -> list[str]:
    """What is wrong with the final model of ``output_dir``, one short phrase each (empty: intact): files that
    :data:`FINAL_MARKER` lists, deleted, cut short or rewritten since; a safetensors file whose size is not the one
    its header gives (also for a final model saved before the marker existed); no weights at all."""
    root = Path(output_dir)
    problems = _listed_problems(root, FINAL_MARKER) if (root / FINAL_MARKER).is_file() else []
    files = final_model_files(root)
    if not any(p.suffix in (".safetensors", ".bin") for p in files):
        problems.append("no model weights")
    for path in files:
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
            if problem and not any(q.startswith(path.name + " ") for q in problems):
                problems.append(problem)
    return problems


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
        # the newest complete checkpoint that is intact; a damaged one is skipped with a one-line warning
        found = next((p for p in reversed(complete_checkpoints(output_dir)) if _intact_or_warn(p)), None)
        if found is None:
            others = list_checkpoints(output_dir)
            raise ValueError(
                f"--resume_from_checkpoint last: no complete checkpoint in {output_dir} that is intact"
                + (f" (only incomplete ones or damaged ones: {[p.name for p in others]})" if others else "")
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
    problems = checkpoint_problems(path)
    if problems:
        raise ValueError(
            f"--resume_from_checkpoint {path} is damaged ({'; '.join(problems)}): a file was deleted, cut short "
            f"or rewritten after its {COMPLETE_MARKER}; pass another checkpoint, or `last`"
        )
    return str(path)


def check_resume_compatible(checkpoint, config, world_size: int | None = None, run: dict | None = None) -> None:
    """Raise if ``checkpoint``'s config.json has another objective, plan or model size than ``config``, or its
    marker another ``run`` setting (``block_size``: the blocks, and so every batch, would differ);
    warn if it was saved by another number of processes (the run goes on, but not exactly as it would have)."""
    marker = Path(checkpoint) / COMPLETE_MARKER
    saved_run = (json.loads(marker.read_text()).get("run") or {}) if marker.is_file() else {}
    for key, value in (run or {}).items():
        if key in saved_run and saved_run[key] != value:
            raise ValueError(
                f"cannot resume from {checkpoint}: it was trained with --{key} {saved_run[key]}, this run has "
                f"--{key} {value}; resume with --{key} {saved_run[key]}, or start a new run from its weights with "
                "--model_name_or_path (without --resume_from_checkpoint)"
            )
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
        if key == "prediction_stream" and saved.get(key) is None:
            continue  # older checkpoints did not record it (their config infers it when loaded)
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


def missing_training_state(checkpoint, world_size: int = 1) -> list[str]:
    """What ``Trainer`` would silently not restore from ``checkpoint`` besides the weights, one phrase each (empty:
    everything is there): the optimizer state, the learning-rate schedule, the RNG state of each process, the
    trainer state (step, data position). A ``--save_only_model`` checkpoint lacks all but the last.

    The RNG files are required only when the checkpoint was saved by ``world_size`` processes (or does not say):
    with another number of processes they cannot be restored anyway, which :func:`check_resume_compatible` says."""
    folder = Path(checkpoint)
    missing = []
    subdirs = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    optimizer = ((folder / "optimizer.pt").is_file() or (folder / "optimizer.bin").is_file()
                 or any("optimizer" in name or name.startswith("global_step") for name in subdirs))  # FSDP, DeepSpeed
    if not optimizer:
        missing.append("the optimizer state (optimizer.pt)")
    if not (folder / "scheduler.pt").is_file():
        missing.append("the learning-rate schedule (scheduler.pt)")
    marker = folder / COMPLETE_MARKER
    try:
        saved_world = json.loads(marker.read_text()).get("world_size") if marker.is_file() else None
    except (OSError, ValueError):
        saved_world = None
    if saved_world in (None, world_size):
        names = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{i}.pth" for i in range(world_size)]
        absent = [name for name in names if not (folder / name).is_file()]
        if absent:
            missing.append(f"the RNG state ({', '.join(absent)})")
    if not (folder / "trainer_state.json").is_file():
        missing.append("the trainer state (trainer_state.json: the step and the data position)")
    return missing


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


def _save_failure(err: BaseException, folder) -> str | None:
    """Why a save failed, when it is the storage's fault (a full disk, a file-size limit), else None."""
    text = str(err)
    if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in text \
            or "StorageFull" in text:  # the last two: safetensors' SafetensorError, torch.save
        return "the disk is full (no space left on device); free some space or give an --output_dir on another disk"
    try:  # torch.save says only "file write failed" or "unexpected pos": look at the disk itself
        full = shutil.disk_usage(Path(folder).parent).free < (1 << 20)
    except OSError:
        full = False
    if full and ("write" in text or "unexpected pos" in text):
        return "the disk is full (no space left on device); free some space or give an --output_dir on another disk"
    if (isinstance(err, OSError) and err.errno == errno.EFBIG) or "File too large" in text \
            or "unexpected pos" in text or "file write failed" in text:
        return ("a file could not be written whole (file too large: a file-size limit such as `ulimit -f`, or the "
                "largest file of this file system); raise the limit or give an --output_dir on another file system")
    return None


@contextmanager
def save_failure_is_one_line(folder):
    """A save that fails because of the storage (a full disk, a file-size limit) raises ``OSError`` naming the folder
    and what to do (the CLI prints it as one line), instead of safetensors' or torch's own error ("unexpected pos")
    deep in a traceback. Other errors pass unchanged. The folder's marker is written only after a save succeeds,
    so the half-written folder never counts as a checkpoint (nor a half-written final model as finished)."""
    try:
        yield
    except Exception as err:
        reason = _save_failure(err, folder)
        if reason is None:
            raise
        raise OSError(f"saving into {folder} failed: {reason}, then rerun with --resume_from_checkpoint last "
                      "(with --overwrite_output_dir instead if no checkpoint was complete yet)") from err


@contextmanager
def unsafe_pickle_is_one_line(checkpoint, files: str):
    """torch refuses (``weights_only=True``) a state file that would import or run code when loaded: a file no
    training run wrote. Say so in one line, instead of torch's traceback, which suggests ``weights_only=False``."""
    import pickle

    try:
        yield
    except pickle.UnpicklingError as err:
        found = re.findall(r"GLOBAL ([\w.]+)", str(err))  # what it would import, e.g. posix.system
        raise ValueError(
            f"{files} in {checkpoint} is not a state saved by training: loading it would run code, so it was refused "
            f"({'it imports ' + found[0] if found else 'not a plain tensor file'}); do not load it with weights_only=False unless you "
            "made it: resume from another checkpoint"
        ) from None


# ---------------------------------------------------------------------------------------------
# output_dir: one run, one writer
# ---------------------------------------------------------------------------------------------
_FINAL_FILES = ("model.safetensors", "pytorch_model.bin", "trainer_state.json", "all_results.json")


def check_output_dir(output_dir, resume_from_checkpoint, overwrite_output_dir: bool) -> None:
    """Refuse a new run in a folder that holds checkpoints or a finished model of another run (without
    ``--resume_from_checkpoint`` or ``--overwrite_output_dir``): the checkpoints of both would mix.

    With ``--overwrite_output_dir`` the old run's ``checkpoint-N`` folders are deleted first, so that neither
    ``last`` nor a save of the new run ever meets them."""
    root = Path(output_dir)
    if resume_from_checkpoint not in (None, "", False, "False", "false") or not root.is_dir():
        return
    checkpoints = list_checkpoints(root)
    finished = [name for name in _FINAL_FILES if (root / name).is_file()]
    if not (checkpoints or finished):
        return
    if overwrite_output_dir:
        for path in checkpoints:
            logger.warning("--overwrite_output_dir: deleting %s of the earlier run", path)
            shutil.rmtree(path)
        return
    held = [p.name for p in checkpoints[-3:]] + finished[:1]
    raise ValueError(
        f"--output_dir {root} already holds another run ({', '.join(held)}{', ...' if len(checkpoints) > 3 else ''}): "
        "pass --resume_from_checkpoint last to continue it, --overwrite_output_dir to replace it, "
        "or another --output_dir"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


class OutputDirLock:
    """``output_dir/.hf_lookaround.lock``, holding the writer's PID and host: a second run writing the same
    folder at once is refused. A lock left by a dead process of this host (a SIGKILL) is taken over with a
    warning; one of another host cannot be checked, so it is refused (delete it if no run writes there)."""

    def __init__(self, output_dir):
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def _record(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def acquire(self) -> "OutputDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = json.loads(self.path.read_text())
                except FileNotFoundError:
                    continue  # released meanwhile
                except (OSError, ValueError):
                    owner = None
                if not isinstance(owner, dict):
                    if self._unreadable_lock_is_stale():
                        continue
                    raise ValueError(
                        f"--output_dir {self.path.parent}: the lock {self.path} is empty or not a lock record (a run "
                        f"starting this very moment writes it); if no run writes there, delete {self.path}")
                pid, host = owner.get("pid"), owner.get("host")
                if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
                    logger.warning("taking over the stale lock %s of process %d on %s, which is dead",
                                   self.path, pid, host)
                    self.path.unlink(missing_ok=True)
                    continue
                raise ValueError(
                    f"--output_dir {self.path.parent} is in use by another run (pid {pid} on host {host}, since "
                    f"{owner.get('since', '?')}): one run writes one output_dir; if no run writes there, "
                    f"delete {self.path}"
                )
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
            self.held = True
            return self
        raise ValueError(f"could not take the lock {self.path}: other runs keep taking it")

    def _unreadable_lock_is_stale(self) -> bool:
        """A lock file that is empty or not JSON: a writer killed between creating the file and writing its record
        (the only moment it is empty), or a file damaged by hand. Older than ``STALE_UNREADABLE_LOCK_S`` it is no
        run's: taken over with a warning. Younger, another run may be writing its record now: refused."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return True  # released meanwhile: try again
        if age < STALE_UNREADABLE_LOCK_S:
            return False
        logger.warning("taking over the lock %s: it is empty or not a lock record, %.0f s old (a run killed as it "
                       "took the lock)", self.path, age)
        self.path.unlink(missing_ok=True)
        return True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


# ---------------------------------------------------------------------------------------------
# the resume decision of a pretrain run
# ---------------------------------------------------------------------------------------------
# what the checkpoints of output_dir leave a run to do: train (from scratch, or on from a checkpoint); save the final
# model again from the checkpoint that ends the training, training nothing; or nothing (finished, final model intact)
TRAIN, SAVE_FINAL, FINISHED = "train", "save_final", "finished"


@dataclass(frozen=True)
class ResumeDecision:
    checkpoint: str | None  # the checkpoint to go on from (None: train from scratch)
    action: str  # TRAIN, SAVE_FINAL or FINISHED


def decide_resume(training_args, model_config, run_settings: dict | None = None) -> ResumeDecision:
    """What a ``pretrain`` run does with the checkpoints of its ``output_dir`` (``--resume_from_checkpoint``).

    The main process first moves aside what a killed save left; then every process finds the same checkpoint, and
    the checkpoints after it (the future this run replaces, and damaged ones) go aside. A checkpoint to resume from
    is checked (weights complete and finite, the same objective and model size, the training state there unless
    ``--resume_weights_only``). One that ends the training (``--max_steps`` or the epochs reached) trains nothing:
    FINISHED where the final model is saved and intact, else SAVE_FINAL."""
    if not training_args.do_train:
        return ResumeDecision(None, TRAIN)
    with training_args.main_process_first(desc="checking checkpoints"):
        if training_args.should_save:
            remove_incomplete_checkpoints(training_args.output_dir)
        checkpoint = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
        if training_args.should_save:
            set_aside_later_checkpoints(training_args.output_dir, checkpoint)
    if checkpoint is None:
        return ResumeDecision(None, TRAIN)
    from ..hub.weights import check_kind, check_local_checkpoint

    command = "hf-lookaround pretrain --resume_from_checkpoint"
    if sharded_weights(checkpoint) is not None:
        # SHARDED_STATE_DICT: the weights are shards, which DCP loads strictly (names and shapes); not read here
        check_kind(checkpoint, command)
        check_sharded_weights(checkpoint)
    else:
        # Trainer loads a checkpoint's weights non-strictly: missing, unexpected or NaN tensors are refused here
        check_local_checkpoint(checkpoint, command, finite=True)
    check_resume_compatible(checkpoint, model_config, training_args.world_size, run=run_settings)
    if not finished_training(checkpoint, training_args):
        check_training_state(checkpoint, training_args)
        return ResumeDecision(checkpoint, TRAIN)
    return ResumeDecision(checkpoint, FINISHED if final_model_saved(training_args.output_dir, checkpoint) else SAVE_FINAL)


def trainer_state_step(checkpoint) -> int:
    """The global step recorded in ``checkpoint``'s ``trainer_state.json``."""
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text()).get("global_step", 0)



def finished_training(checkpoint, training_args) -> bool:
    """Whether ``checkpoint`` is the end of the training this run asks for (its step reached ``--max_steps``,
    or its epochs ``--num_train_epochs``): resuming from it must train nothing more."""
    path = Path(checkpoint) / "trainer_state.json"
    if not path.is_file():
        return False
    state = json.loads(path.read_text())
    step = state.get("global_step", 0)
    if training_args.max_steps > 0:
        return step >= training_args.max_steps
    return step >= state.get("max_steps", float("inf")) and state.get("epoch", 0) >= training_args.num_train_epochs


def final_model_saved(output_dir, checkpoint) -> bool:
    """Whether ``output_dir`` holds the final model of ``checkpoint`` (the end of the training), intact: a final
    model that is missing, of another step, or damaged (:func:`final_model_problems`) is written
    again from the checkpoint, with a warning for a damaged one."""
    root = Path(output_dir)
    final_state = root / "trainer_state.json"
    if not (final_state.is_file() and (root / "config.json").is_file()):
        return False
    problems = final_model_problems(root)
    try:
        same_step = json.loads(final_state.read_text()).get("global_step") == trainer_state_step(checkpoint)
    except (OSError, ValueError) as err:
        problems.append(f"trainer_state.json unreadable ({type(err).__name__})")
        same_step = True
    if not same_step:
        return False
    if problems:
        logger.warning("the final model in %s is damaged (%s): writing it again from %s", root,
                       "; ".join(problems), checkpoint)
        return False
    return True


def check_training_state(checkpoint, training_args) -> None:
    """Refuse to resume from ``checkpoint`` if it lacks state besides the weights (``Trainer`` would go on with a
    fresh optimizer, schedule or RNG and say nothing), unless ``--resume_weights_only true``: then warn."""
    missing = missing_training_state(checkpoint, training_args.world_size)
    if not missing:
        return
    if not getattr(training_args, "resume_weights_only", False):
        raise ValueError(
            f"cannot resume from {checkpoint}: it holds no {'; no '.join(missing)} (a --save_only_model checkpoint, "
            "or files deleted), so the run would go on with a fresh one; pass --resume_weights_only true to go on "
            "from its weights anyway, or resume from a checkpoint that holds them"
        )
    logger.warning("--resume_weights_only: resuming from the weights of %s; not restored, started fresh: %s",
                   checkpoint, "; ".join(missing))


# ---------------------------------------------------------------------------------------------
# FSDP2 under SHARDED_STATE_DICT: what each save writes
# ---------------------------------------------------------------------------------------------
# Trainer.save_model writes weights only under FULL_STATE_DICT. Under SHARDED_STATE_DICT a checkpoint's weights are
# the shards Trainer writes beside the optimizer's (hub.weights.SHARDED_MODEL_DIR, which accelerate reads on
# resume), and nothing else: no config.json, which the resume checks read. So a checkpoint gets the config,
# generation config and tokenizer but no gathered copy of the weights (gathering at every save is what
# SHARDED_STATE_DICT avoids); a LoRA run's checkpoint still gathers (its merged weights and adapter file are what it
# resumes from); and the final model is always gathered, a full model.safetensors as FULL_STATE_DICT writes.


# what state_for_sharded_save answers for a checkpoint whose weights are Trainer's shards (compared by identity)
WEIGHTS_ARE_SHARDS = MappingProxyType({})


def is_sharded(model) -> bool:
    """Whether FSDP2 (``fully_shard``) holds the model's parameters as shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def full_state_dict(model) -> dict:
    """The full state dict of a model FSDP2 shards, gathered onto rank 0's CPU (the other ranks get an empty dict).
    A collective: every rank must call it (on rank 0 alone it waits for the others for ever)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def saves_sharded_state_dict(trainer) -> bool:
    """Whether ``trainer`` runs FSDP with a state dict type other than FULL_STATE_DICT (SHARDED_STATE_DICT)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(getattr(trainer, "is_fsdp_enabled", False) and plugin is not None
                and "FULL_STATE_DICT" not in str(plugin.state_dict_type))


def check_sharded_saving(trainer) -> None:
    """Refuse, in one line, FSDP1 with SHARDED_STATE_DICT: its flat parameters are no DTensors, so the final
    model cannot be gathered here (FSDP2, the recipe's, or FULL_STATE_DICT can)."""
    if saves_sharded_state_dict(trainer) and getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2:
        raise ValueError("fsdp_state_dict_type SHARDED_STATE_DICT under FSDP version 1 is not supported: use FSDP2 "
                         "(fsdp_version: 2, as examples/accelerate/fsdp.yaml does) or FULL_STATE_DICT")


def state_for_sharded_save(trainer, output_dir, adapters: bool = False) -> dict | None:
    """What ``LookAroundTrainer.save_model`` writes into ``output_dir`` beside Trainer's own save, under FSDP's
    SHARDED_STATE_DICT (see the note above): None where Trainer saves as usual (no FSDP, FULL_STATE_DICT);
    :data:`WEIGHTS_ARE_SHARDS` for a checkpoint that gets config and tokenizer but no weights (a run without
    ``adapters``); else the full state dict to write as ``model.safetensors`` (the final model, a LoRA run's
    checkpoint), gathered on every rank (only rank 0's holds the tensors). Call it on every rank."""
    if not saves_sharded_state_dict(trainer):
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not is_sharded(model):
        # no training wrapped it: a final model written again from its checkpoint (loaded in full on every rank)
        return model.state_dict()
    if _CHECKPOINT_RE.match(Path(output_dir).name) and not adapters:
        return WEIGHTS_ARE_SHARDS
    return full_state_dict(model)


def full_weights_for_unwrapped_fsdp_model(trainer, model, folder) -> bool:
    """Whether ``folder`` (a final model: ``model.safetensors``, no FSDP files) is to be read into ``model`` under FSDP
    as without it: no training sharded the model (a finished run evaluated again), and Trainer's FSDP load would look
    for files a final model does not hold (``pytorch_model_fsdp.bin`` or the shards)."""
    folder = Path(folder)
    return bool(getattr(trainer, "is_fsdp_enabled", False) and not is_sharded(model)
                and (folder / "model.safetensors").is_file() and not list(folder.glob("pytorch_model_fsdp*")))


def sharded_weights(checkpoint) -> Path | None:
    """The folder of model shards (``hub.weights.SHARDED_MODEL_DIR``) of a checkpoint saved under
    SHARDED_STATE_DICT that holds no full weights, or None."""
    from ..hub.weights import SHARDED_MODEL_DIR

    folder = Path(checkpoint)
    shards = folder / SHARDED_MODEL_DIR
    if not shards.is_dir() or (folder / "model.safetensors").is_file() or \
            (folder / "model.safetensors.index.json").is_file():
        return None
    return shards


def check_sharded_weights(checkpoint) -> None:
    """Refuse, in one line, a checkpoint whose model shards torch cannot read (their ``.metadata`` missing or
    cut). Names and shapes are checked against the model when the shards load (DCP's load is strict)."""
    from torch.distributed.checkpoint import FileSystemReader

    shards = sharded_weights(checkpoint)
    try:
        metadata = FileSystemReader(str(shards)).read_metadata()
    except Exception as err:  # noqa: BLE001 - torch raises several types for a missing or cut file
        raise ValueError(f"cannot resume from {checkpoint}: its model shards ({shards.name}) are unreadable "
                         f"({type(err).__name__}); resume from another checkpoint") from None
    if not any(key.startswith("model.") for key in metadata.state_dict_metadata):
        raise ValueError(f"cannot resume from {checkpoint}: its model shards ({shards.name}) hold no model "
                         "weights; resume from another checkpoint")
