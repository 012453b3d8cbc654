"""What ``from_pretrained`` checks before it hands out a LookAround model, in any process that loads one (this
package, lm-evaluation-harness, a plain ``AutoModel`` call, remote code without the package).

``LookAroundPreTrainedModel._finalize_model_loading`` (transformers' step after the weights are read) calls
:func:`check_loaded`, which refuses, in one line:

- the ``output_dir`` of a ``pretrain`` run that has not finished (its lock is there and its final marker is not):
  the weights may be a save cut short or a run still writing;
- weights that leave tensors of the backbone out (transformers would re-initialise them with a warning): a head
  that is new for the checkpoint (a classifier, a fresh LM head) may be missing, the shared backbone may not;
- weights that hold NaN or infinity (a run that diverged).

The marker and lock names live here, in the bundle, and the package's checkpointing imports them (the bundle
never imports the package).
"""

from __future__ import annotations

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


def _listed(names, limit: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


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
                         f"({_listed(backbone)}): from_pretrained would re-initialise them at random. The weights "
                         "file is incomplete or of another model: save the model again, or use an intact checkpoint")
    bad = [name for name, t in model.named_parameters()
           if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"the weights of {source} hold NaN or infinite values in {len(bad)} tensor(s) "
                         f"({_listed(bad)}): the training diverged or the file is damaged; use an earlier "
                         "checkpoint (checkpoint-N) or train again (a lower --learning_rate)")
