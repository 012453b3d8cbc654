"""Audit a plan from the outside: which input tokens does the loss at each target depend on?

The loss at target ``t`` must have exactly zero gradient with respect to the input embedding of
every token of rank ``>= g[t]`` (and of padding, and of other rows of the batch), and a non-zero
gradient for some token it may see. This runs on any backend with a backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F


@dataclass
class LeakReport:
    targets_checked: int = 0
    targets_seeing_something: int = 0
    leaks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, target, leaking positions)
    blind: list[tuple[int, int]] = field(default_factory=list)  # targets with visible tokens but no gradient

    @property
    def ok(self) -> bool:
        return not self.leaks and not self.blind


def audit_two_stream(model, input_ids, attention_mask, group_ids, is_target, compiled: bool = False,
                     compile_kwargs: dict | None = None, compiled_model=None) -> LeakReport:
    """Gradient audit of a `LookAroundForPreTraining` on one batch and plan.

    `compiled=True` audits the compiled training path: targets padded to the static width T, the masks built
    outside the graph (`model.prepare_attention`) and the forward under `torch.compile(**compile_kwargs)`, or
    through `compiled_model` (a compiled wrapper of `model`, to reuse its graphs across audits)."""
    labels = torch.where(is_target, input_ids, -100)
    embeds = model.get_input_embeddings()(input_ids).detach().float().requires_grad_(True)
    batch = dict(inputs_embeds=embeds.to(model.dtype), attention_mask=attention_mask, group_ids=group_ids,
                 labels=labels)
    forward = model
    if compiled:
        from .plans import target_positions_from_mask

        batch["target_positions"] = target_positions_from_mask(is_target, pad_to=input_ids.shape[1])
        batch["prepared_attention"] = model.prepare_attention(**batch)
        forward = compiled_model if compiled_model is not None else torch.compile(model, **(compile_kwargs or {}))
    out = forward(**batch)
    if not torch.isfinite(out.logits).all():
        raise AssertionError("non-finite logits")
    report = LeakReport()
    for b in range(input_ids.shape[0]):
        for m, t in enumerate(out.target_positions[b].tolist()):
            if t < 0:
                continue
            loss_t = F.cross_entropy(out.logits[b, m].float(), labels[b, t])
            (grad,) = torch.autograd.grad(loss_t, embeds, retain_graph=True)
            per_token = grad.abs().sum(-1)  # (B, T)
            must_not_see = torch.ones_like(per_token, dtype=torch.bool)
            must_not_see[b] = (group_ids[b] >= group_ids[b, t]) | (attention_mask[b] == 0)
            report.targets_checked += 1
            leaking = (must_not_see & (per_token != 0)).nonzero()
            if len(leaking):
                report.leaks.append((b, t, leaking.tolist()))
            visible = ~must_not_see[b]
            if visible.any():
                report.targets_seeing_something += 1
                if per_token[b][visible].max() == 0:
                    report.blind.append((b, t))
    return report
