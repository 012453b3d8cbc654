"""A run that diverges stops, in one line: :class:`FiniteTrainingGuard`, a ``TrainerCallback`` that every
``build_trainer`` run carries.

``Trainer`` goes on after a NaN or infinite loss (``grad_norm nan`` in the log, the weights NaN from the next
step on), saves checkpoints of those weights and ends with rc 0. The guard checks what the Trainer already has
in hand, at no extra cost per step: the logged ``loss``, ``grad_norm`` and ``eval_loss``; and, only when a
checkpoint or the final model is about to be written, that the weights are finite. So no checkpoint marker and no
final-model marker is ever written for non-finite weights, and the error names the step and the last good
checkpoint to resume from.
"""

from __future__ import annotations

import math
from pathlib import Path

from transformers import TrainerCallback

from . import checkpointing

WATCHED = ("loss", "grad_norm", "eval_loss")


class TrainingDiverged(ValueError):
    """The loss, the gradient norm or the weights became NaN or infinite."""


def _non_finite_parameters(model) -> list[str]:
    import torch

    return [name for name, p in model.named_parameters()
            if p.is_floating_point() and not bool(torch.isfinite(p).all())]


class FiniteTrainingGuard(TrainerCallback):
    """Stop the run with :class:`TrainingDiverged` when a logged value or, at a save, a weight is not finite."""

    def _stop(self, args, step: int, what: str):
        last = checkpointing.last_complete_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
        resume = (f"the last good checkpoint is {last}: resume from it with a lower --learning_rate "
                  "(--resume_from_checkpoint last keeps its schedule; start again for a new one)"
                  if last is not None else "no checkpoint was saved before it: train again with a lower --learning_rate")
        raise TrainingDiverged(f"training diverged at step {step}: {what}; nothing was saved from it, and {resume}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        bad = {k: v for k, v in (logs or {}).items()
               if k in WATCHED and isinstance(v, (int, float)) and not math.isfinite(v)}
        if bad:
            self._stop(args, state.global_step, ", ".join(f"{k} {v}" for k, v in bad.items()))

    def _check_weights(self, args, state, model):
        bad = _non_finite_parameters(model) if model is not None else []
        if bad:
            names = ", ".join(bad[:3]) + (f", ... ({len(bad)} in all)" if len(bad) > 3 else "")
            self._stop(args, state.global_step, f"the weights hold NaN or infinite values ({names})")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if control.should_save:  # a checkpoint is about to be written and marked complete
            self._check_weights(args, state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._check_weights(args, state, model)  # before the final model is saved and marked
