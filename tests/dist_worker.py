"""Worker scripts that tests/test_distributed.py launches with ``torchrun --nproc_per_node 2`` (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_worker.py pretrain ARGS...
    ... tests/dist_worker.py ddp GRADS.json HEADS.json

``pretrain`` runs ``hf-lookaround pretrain`` (``hf_lookaround.cli.pretrain.main``) unchanged, except that its Trainer
records what each rank trained on, and can SIGKILL itself at a chosen moment:

- ``LOOKAROUND_TEST_RECORD=DIR``: every rank appends its batches to ``DIR/rank{r}.jsonl`` and, when training ends,
  writes a digest of its model's final weights to ``DIR/weights{r}.json`` (replicas must agree);
- ``LOOKAROUND_TEST_KILL=train:N``: every rank kills itself (SIGKILL) when about to run step N+1;
- ``LOOKAROUND_TEST_KILL=save:N``: every rank kills itself in the middle of saving checkpoint-N
  (the weights are written, the optimizer, RNG states and trainer state are not).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _kill_point():
    spec = os.environ.get("LOOKAROUND_TEST_KILL")
    if not spec:
        return None, None
    where, _, step = spec.partition(":")
    return where, int(step)


def pretrain(argv):
    from hf_lookaround.cli.pretrain import main
    from hf_lookaround.training import pretraining

    where, kill_step = _kill_point()
    record_dir = os.environ.get("LOOKAROUND_TEST_RECORD")

    class InstrumentedTrainer(pretraining.LookAroundTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if where == "train" and self.state.global_step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if record_dir:
                rank = dist.get_rank() if dist.is_initialized() else 0
                row = {
                    "step": self.state.global_step,
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "collator_rank": self.data_collator._rank(),
                    "find_unused_parameters": getattr(model, "find_unused_parameters", None),
                    "epoch": self.data_collator.epoch,
                    "input_ids": inputs["input_ids"].tolist(),
                    # a one-stream form built once per shape (dar's block-causal mask) has no group ids per batch
                    "group_ids": inputs["group_ids"].tolist() if "group_ids" in inputs else None,
                }
                with open(Path(record_dir) / f"rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
            return super().training_step(model, inputs, num_items_in_batch)

        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            if record_dir:  # every rank's own weights after training (a LoRA run's merged at its end)
                import hashlib

                rank = dist.get_rank() if dist.is_initialized() else 0
                state = self.accelerator.unwrap_model(self.model).state_dict()
                digest = {name: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                                               .tobytes()).hexdigest() for name, t in state.items()}
                (Path(record_dir) / f"weights{rank}.json").write_text(json.dumps(digest))
            return result

        def _save_optimizer_and_scheduler(self, output_dir):
            if where == "save" and self.state.global_step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._save_optimizer_and_scheduler(output_dir)

        def _save(self, output_dir=None, state_dict=None):
            # Trainer calls _save only on the process that writes: count who wrote what
            if record_dir:
                rank = dist.get_rank() if dist.is_initialized() else 0
                with open(Path(record_dir) / f"saves{rank}.txt", "a") as f:
                    f.write(f"{output_dir}\n")
            return super()._save(output_dir, state_dict)

    pretraining.LookAroundTrainer = InstrumentedTrainer
    return main(argv)


def _tiny_config(**overrides):
    from hf_lookaround import LookAroundConfig

    return LookAroundConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64, **overrides)


class _Tokenizer:
    pad_token_id, bos_token_id, eos_token_id, mask_token_id = 0, 1, 2, 3
    cls_token_id = sep_token_id = None

    def __len__(self):
        return 64


def _blocks(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(4, 64, (n, length - 1), generator=g)
    return torch.cat([torch.ones(n, 1, dtype=torch.long), body], 1)


def ddp(grads_out, heads_out):
    dist.init_process_group("gloo")
    grads(grads_out)
    heads(heads_out)
    # leave together: a gloo group torn down while a peer is gone can hang
    dist.barrier()
    dist.destroy_process_group()


def grads(out):
    """One step of DDP on 2 ranks x b examples against one process on the same 2b examples and plans."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_lookaround import LookAroundForPreTraining
    from hf_lookaround.objectives import make_collator

    rank, world = dist.get_rank(), dist.get_world_size()
    b = 3
    # every rank builds the same 2b-example batch and plans (variable-ratio masking: the number of
    # targets differs from row to row), then keeps its own b rows
    collator = make_collator("vmlm", _Tokenizer(), seed=5, mask_ratio_range=(0.15, 0.5), process_rank=0)
    full = collator([{"input_ids": row} for row in _blocks(b * world, 16, seed=1).tolist()])
    n_targets = int((full["labels"] != -100).sum())
    mine = {k: v[rank * b:(rank + 1) * b] for k, v in full.items()}

    torch.manual_seed(0)
    model = LookAroundForPreTraining(_tiny_config())
    reference = LookAroundForPreTraining(_tiny_config())
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model)
    # the token-sum form Trainer uses across devices: each rank's summed loss over the global count of
    # targets, times the world size (DDP averages gradients over ranks)
    loss = ddp(**mine, num_items_in_batch=torch.tensor(n_targets)).loss * world
    loss.backward()
    # one process, 2b examples: the usual mean over all targets
    reference(**full).loss.backward()
    result = {"world_size": world, "n_targets": n_targets,
              "rank_targets": int((mine["labels"] != -100).sum()), "max_abs_diff": 0.0, "max_abs_grad": 0.0}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            continue
        result["max_abs_diff"] = max(result["max_abs_diff"], float((p.grad - q.grad).abs().max()))
        result["max_abs_grad"] = max(result["max_abs_grad"], float(q.grad.abs().max()))
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def heads(out):
    """Every head trains a few steps under DDP with find_unused_parameters=False."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_lookaround import (
        LookAroundForCausalLM,
        LookAroundForMaskedLM,
        LookAroundForPreTraining,
        LookAroundForSequenceClassification,
    )
    from hf_lookaround.objectives import make_collator

    rank, world = dist.get_rank(), dist.get_world_size()
    tok = _Tokenizer()

    def batch(head, step):
        ids = _blocks(4, 16, seed=100 * step + rank)
        features = [{"input_ids": row} for row in ids.tolist()]
        if head is LookAroundForPreTraining:
            return make_collator("dar", tok, seed=step, group_size=2)(features)
        if head is LookAroundForMaskedLM:
            return make_collator("mlm", tok, seed=step, mask_ratio=0.3, form="single_stream")(features)
        if head is LookAroundForCausalLM:
            return {"input_ids": ids, "labels": ids}
        return {"input_ids": ids, "labels": ids[:, 1] % 2}

    results = {}
    for head in (LookAroundForPreTraining, LookAroundForCausalLM, LookAroundForMaskedLM,
                 LookAroundForSequenceClassification):
        torch.manual_seed(0)
        model = head(_tiny_config(num_labels=2))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ddp = DDP(model, find_unused_parameters=False)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        try:
            losses = []
            for step in range(3):
                loss = ddp(**batch(head, step)).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss.detach()))
            # DDP keeps the replicas identical: every trained parameter moved, and agrees across ranks
            moved = sum(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            copies = [torch.zeros_like(flat) for _ in range(world)]
            dist.all_gather(copies, flat)
            results[head.__name__] = {
                "ok": True, "losses": losses, "moved": moved,
                "trainable": sum(p.requires_grad for p in model.parameters()),
                "replicas_equal": all(torch.equal(copies[0], c) for c in copies),
            }
        except Exception as error:  # noqa: BLE001  (reported to the test, which fails with the message)
            results[head.__name__] = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
            break  # a failed reduction leaves the ranks out of step: later collectives would hang
    if rank == 0:
        Path(out).write_text(json.dumps({"world_size": world, "results": results}))


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "pretrain":
        sys.exit(pretrain(rest))
    {"ddp": ddp}[command](*rest)
