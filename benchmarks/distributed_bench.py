"""Data-parallel scaling of two-stream semi-AR pretraining: 1 GPU vs DDP and FSDP2 on 2 GPUs.

One command runs everything (it launches ``torchrun`` itself, one launch per setting):

    python benchmarks/distributed_bench.py --all --output distributed_bench.json

- model: ``LookAroundForPreTraining`` at the ``base`` preset (768 x 12 layers), objective ``dar``
  with t = 2 (the package's collator draws the plans), SDPA attention, AdamW;
- the same per-GPU batch in every setting (``--batch-size`` blocks of ``--seq-len`` tokens), random
  tokens (throughput does not depend on the text), batches collated before the clock starts;
- single: one process, bf16 autocast; ddp: ``DistributedDataParallel``, bf16 autocast, fp32
  gradients all-reduced; fsdp: FSDP2 ``fully_shard`` on every ``LookAroundLayer`` and the root,
  bf16 parameters in compute, fp32 gradient reduction (what ``examples/accelerate/fsdp.yaml`` does);
- reported: tokens/s over all GPUs, speedup against the one-GPU run, tokens/s per GPU, peak memory
  allocated per GPU, the last loss.

``--smoke`` runs the same three settings on the CPU (gloo, ``tiny`` preset, a few steps): it checks
the code paths, its numbers mean nothing. Needs torch, transformers and this package; not datasets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

SETTINGS = [("single", 1), ("ddp", 2), ("fsdp", 2)]


class _Tokenizer:
    """The ids the collator needs (BOS starts every block; nothing is padded)."""

    pad_token_id, bos_token_id, eos_token_id, mask_token_id = 0, 1, 2, 3
    cls_token_id = sep_token_id = None

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def __len__(self):
        return self.vocab_size


# ------------------------------------------------------------------------------------------------
# one setting, in each process of a torchrun launch
# ------------------------------------------------------------------------------------------------
def worker(args) -> None:
    from hf_lookaround import LookAroundConfig, LookAroundForPreTraining
    from hf_lookaround.objectives import make_collator

    cuda = torch.cuda.is_available() and not args.smoke
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial weights on every rank
    config = LookAroundConfig.from_preset(args.preset, vocab_size=args.vocab_size,
                                          max_position_embeddings=max(args.seq_len, 64), objective="dar",
                                          plan_params={"t": 2}, default_attention="causal")
    model = LookAroundForPreTraining._from_config(config, attn_implementation="sdpa").to(device)
    n_params = sum(p.numel() for p in model.parameters())

    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[local_rank] if cuda else None, gradient_as_bucket_view=True)
    elif args.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from hf_lookaround.models.lookaround.modeling_lookaround import LookAroundLayer

        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in model.modules():
            if isinstance(module, LookAroundLayer):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        autocast = torch.autocast(device.type, enabled=False)  # FSDP2 casts the parameters itself
    # torch's default AdamW implementation (foreach on CUDA) in every setting, DTensor parameters included
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    # each rank its own blocks; the package's collator draws each rank's plans
    collator = make_collator("dar", _Tokenizer(args.vocab_size), seed=0, group_size=2, pad_targets_to=args.seq_len)
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(args.distinct_batches):
        body = torch.randint(4, args.vocab_size, (args.batch_size, args.seq_len - 1), generator=generator)
        ids = torch.cat([torch.ones(args.batch_size, 1, dtype=torch.long), body], 1)
        batch = collator([{"input_ids": row} for row in ids])
        batches.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def step(i):
        with autocast:
            loss = model(**batches[i % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    sync()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    row = {"rank": rank, "peak_memory_gib": peak, "loss": float(loss.detach().float().cpu()), "seconds": elapsed}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        tokens = args.steps * args.batch_size * args.seq_len * world
        seconds = max(r["seconds"] for r in rows)
        result = {
            "mode": args.mode, "world_size": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "preset": args.preset, "parameters": n_params, "per_gpu_batch": args.batch_size, "seq_len": args.seq_len,
            "steps": args.steps, "warmup": args.warmup, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_gpu": tokens / seconds / world,
            "peak_memory_gib_per_gpu": [r["peak_memory_gib"] for r in rows],
            "last_loss": [r["loss"] for r in rows],
        }
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# the driver: one torchrun launch per setting, then the table
# ------------------------------------------------------------------------------------------------
def driver(args) -> dict:
    if not args.smoke:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a host with 2 GPUs, or pass --smoke for the CPU check")
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"DDP and FSDP need 2 GPUs; this host has {torch.cuda.device_count()}")
    forwarded = ["--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--vocab-size", str(args.vocab_size),
                 "--distinct-batches", str(args.distinct_batches)] + (["--smoke"] if args.smoke else [])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if args.smoke else "4")}
    results, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, nproc in SETTINGS:
            if mode not in args.modes:
                continue
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   __file__, "--worker", "--mode", mode, "--result", str(out), *forwarded]
            print(f"[{mode}] {' '.join(cmd)}", flush=True)
            begin = time.perf_counter()
            proc = subprocess.run(cmd, env=env)
            if proc.returncode != 0 or not out.exists():
                # report the settings that ran; say which did not
                failed.append(mode)
                print(f"[{mode}] FAILED (exit code {proc.returncode}); see its output above", flush=True)
                continue
            result = json.loads(out.read_text())
            result["wall_seconds"] = time.perf_counter() - begin
            results.append(result)
    base = next((r for r in results if r["mode"] == "single"), None)
    for r in results:
        r["speedup_vs_1gpu"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "smoke": args.smoke,
              "torch": torch.__version__, "results": results, "failed": failed}
    print(markdown_table(results))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")
    if failed:
        raise SystemExit(f"settings that failed: {failed}")
    return report


def markdown_table(results) -> str:
    lines = ["| setting | GPUs | tokens/s | speedup vs 1 GPU | tokens/s per GPU | peak memory per GPU (GiB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        peaks = r["peak_memory_gib_per_gpu"]
        peak = "n/a (CPU)" if peaks[0] is None else " / ".join(f"{p:.2f}" for p in peaks)
        speedup = "" if r["speedup_vs_1gpu"] is None else f"{r['speedup_vs_1gpu']:.2f}x"
        lines.append(f"| {r['mode']} | {r['world_size']} | {r['tokens_per_s']:,.0f} | {speedup} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {peak} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="run every setting (one torchrun launch each) and report")
    p.add_argument("--modes", nargs="+", default=[m for m, _ in SETTINGS], choices=[m for m, _ in SETTINGS])
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny preset, a few steps: checks the code only")
    p.add_argument("--preset", default=None, help="model size (default: base; tiny with --smoke)")
    p.add_argument("--batch-size", type=int, default=None, help="blocks per GPU and step (default 16; 2 with --smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per block (default 1024; 64 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 50; 3 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; 1 with --smoke)")
    p.add_argument("--vocab-size", type=int, default=None, help="default 32000 (512 with --smoke)")
    p.add_argument("--distinct-batches", type=int, default=4, help="batches collated up front, cycled")
    p.add_argument("--output", default="distributed_bench.json", help="JSON of the results (driver)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=[m for m, _ in SETTINGS], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = dict(preset=("tiny", "base"), batch_size=(2, 16), seq_len=(64, 1024), steps=(3, 50), warmup=(1, 10),
                    vocab_size=(512, 32000))
    for name, (smoke, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.worker:
        return worker(args)
    if not args.all and args.modes == [m for m, _ in SETTINGS]:
        p.error("pass --all (every setting) or --modes ...")
    driver(args)


if __name__ == "__main__":
    main()
