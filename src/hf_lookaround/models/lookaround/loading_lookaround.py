"""What ``from_pretrained`` checks before it hands out a LookAround model, in any process that loads one (this
package, lm-evaluation-harness, a plain ``AutoModel`` call, remote code without the package).

``LookAroundPreTrainedModel._finalize_model_loading`` (transformers' step after the weights are read) calls
:func:`check_loaded`, which refuses, in one line:

- the ``output_dir`` of a ``pretrain`` run that has not finished (its lock is there and its final marker is not):
  the weights may be a save cut short or a run still writing;
- weights that leave tensors of the backbone out (transformers would re-initialise them with a warning): a head
  that is new for the checkpoint (a classifier, a fresh LM head) may be missing, the shared backbone may not;
- weights that hold NaN or infinity (a run that diverged).

``LookAroundPreTrainedModel.from_pretrained`` calls :func:`check_weights_files` first, before transformers reads a
weights file: a safetensors file cut short (or grown) is refused in one line naming it, where safetensors' own
error ("incomplete metadata, file not fully covered") names neither the file nor what to do.

The marker and lock names live here, in the bundle, and the package's checkpointing imports them (the bundle
never imports the package).
"""

from __future__ import annotations

import json
import os

import torch

# written last by `hf-lookaround pretrain`'s final save; its lock file is there while the run is
FINAL_MARKER = "final_model_complete.json"
LOCK_FILE = ".hf_lookaround.lock"


def unfinished_run(folder) -> str | None:
    """Why ``folder`` must not be loaded as a model yet (None: it may): the ``output_dir`` of a ``pretrain`` run
    still writing its final model, or killed before it ended (its lock is there, and :data:`FINAL_MARKER`, written
    last, is not). Its weights may be there without the card or every head's ``auto_map``."""
    folder = str(folder)
    if os.path.isfile(os.path.join(folder, LOCK_FILE)) and not os.path.isfile(os.path.join(folder, FINAL_MARKER)):
        return (f"{folder} is the output_dir of a pretrain run that has not finished ({LOCK_FILE} is there, and "
                f"{FINAL_MARKER}, written last, is not): wait for the run to end (or resume a killed one with "
                "--resume_from_checkpoint last), or load one of its complete checkpoint-N folders")
    return None


def safetensors_problem(path) -> str | None:
    """A safetensors file whose size is not what its header says (cut short, or grown), or an unreadable header."""
    size = os.path.getsize(path)
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return f"{name} has {size} bytes, too few for its header"
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        return f"{name} has an unreadable header ({type(err).__name__})"
    if 8 + n + end != size:
        return f"{name} has {size} bytes, its header says {8 + n + end}"
    return None


def check_weights_files(folder) -> None:
    """Refuse (ValueError, one line) a local folder whose run is unfinished or whose safetensors weights are cut
    short or damaged, before any of them is read (a Hub id or a file is left to transformers)."""
    folder = str(folder)
    if not os.path.isdir(folder):
        return
    problem = unfinished_run(folder)
    if problem:
        raise ValueError(problem)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors") and os.path.isfile(os.path.join(folder, name)):
            problem = safetensors_problem(os.path.join(folder, name))
            if problem:
                raise ValueError(f"the weights of {folder} are truncated or damaged ({problem}): a save was cut "
                                 "short, the disk filled or a copy is partial; save the model again, or use an "
                                 "intact checkpoint")


# what to do about weights that leave tensors out (here, and hub/weights.check_tensors before a load)
INCOMPLETE_WEIGHTS = ("The weights file is incomplete or of another model: save the model again, or use an intact "
                      "checkpoint")


def listed(names, limit: int = 4) -> str:
    """The first ``limit`` of ``names``, and how many there are in all: a one-line error names a few."""
    names = list(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_finite(named_tensors, where) -> None:
    """Refuse weights that hold NaN or infinity (a diverged run, a damaged file): every floating tensor once
    (a meta tensor holds no values). ``from_pretrained`` calls it through :func:`check_loaded`; the package's
    commands also on the tensors of a file (``hub/weights``)."""
    bad = [name for name, t in named_tensors
           if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"the weights of {where} hold NaN or infinite values in {len(bad)} tensor(s) "
                         f"({listed(bad)}): the training diverged or the file is damaged; use an earlier "
                         "checkpoint (checkpoint-N) or train again (a lower --learning_rate)")


def check_loaded(model, source, missing_keys) -> None:
    """Refuse (ValueError, one line) a model loaded from ``source`` by ``from_pretrained`` whose run is unfinished,
    whose backbone tensors were ``missing_keys`` of the weights, or whose weights are not finite."""
    if source is not None and os.path.isdir(str(source)):
        problem = unfinished_run(source)
        if problem:
            raise ValueError(problem)
    prefix = f"{model.base_model_prefix}."
    backbone = sorted(k for k in missing_keys or () if k.startswith(prefix) or model.base_model is model)
    if backbone:
        raise ValueError(f"the weights of {source} lack {len(backbone)} tensor(s) of the backbone "
                         f"({listed(backbone)}): from_pretrained would re-initialise them at random. "
                         f"{INCOMPLETE_WEIGHTS}")
    check_finite(model.named_parameters(), source)
