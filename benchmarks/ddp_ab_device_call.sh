#!/usr/bin/env bash
# Issue 41: an A/B of candidate defaults under DDP on 4 GPUs, one-stream dar t = 2 and the run_clm-style Llama side by
# side, in one call (held under 540 s):
#   run(kind="nvidia-h100-x4", timeout_s=600, command="bash benchmarks/ddp_ab_device_call.sh ddp_ab",
#       carry=[".devdata/whl", ".devdata/bench", ".devdata/text/brown"])
# (.devdata as for benchmarks/scale_device_call.sh.) Every variant is one benchmarks/cli_bench.py call: `base`, bf16,
# compile, 16 x 1024 positions per GPU per step, 10 warm-up and 25 timed steps, accelerate launch with
# examples/accelerate/ddp.yaml on 4 processes, the per-rank timers of --profile (no torch.profiler steps). A variant
# applies to both models where it applies, so the ratio stays fair:
#   A  today's defaults (the scale41 rows again): 608 blocks shared by 4 ranks, so each rank begins a new epoch
#      every 10 steps (3 times in the timed steps);
#   B  a batch per step for every rank (--samples_per_rank, the Brown text three times over): no epoch begins in the
#      timed steps;
#   C  A with --dataloader_persistent_workers true (dar only: Llama's run_clm loader has no workers; its row is A's);
#   D  B with fewer, larger buckets (--ddp_bucket_cap_mb 100; with compile, DDPOptimizer splits the graph at every
#      bucket), no buffer broadcast before each forward, gradients as views of the buckets;
#   E  B with --logging_nan_inf_filter false (Trainer's per-step isnan/isinf of the loss is a host sync).
# Runs in that order (AB_VARIANTS="A B E" runs a subset); one that cannot finish in time is marked skipped. Prints one table, writes $OUT/LABEL.json (each
# variant's cli_bench result) and $OUT/LABEL.logs.txt.
set -uo pipefail
label=${1:-ddp_ab}
source "$(dirname "$0")/device_env.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
budget=${AB_BUDGET_S:-535}
text=.devdata/text/brown/train.jsonl.gz
tripled=/tmp/ddp_ab_text.jsonl.gz  # 3 x 980 blocks: enough for 16 x 35 per rank on 4 ranks
cat "$text" "$text" "$text" > "$tripled"
python3 -c 'import torch; print("GPUs:", torch.cuda.device_count(), "torch", torch.__version__)'

dar="dar t=2, one stream"
want() { [[ " ${AB_VARIANTS:-A B C D E} " == *" $1 "* ]]; }  # AB_VARIANTS="A B E": a subset
variant() {  # NAME TRAIN_FILE RUNS... -- CLI_BENCH_FLAGS...
    local name=$1 file=$2; shift 2
    local runs=(); while [ "$1" != "--" ]; do runs+=("$1"); shift; done; shift
    local left=$((budget - SECONDS - 3))
    echo "=== variant $name (${left} s left)"
    [ "$left" -gt 60 ] || { echo "[ddp_ab] $name: skipped (budget)"; return; }
    python3 benchmarks/cli_bench.py --train_file "$file" --tokenizer .devdata/bench/tok32k --work_dir "/tmp/ddp_ab/$name" \
        --out "$OUT/$label.$name.json" --runs "${runs[@]}" --launch ddp:4 --profile ddp:4 --profile_steps 0 \
        --warmup_steps 10 --timed_steps 25 --timeout_s 160 --expected_run_s 70 --deadline_s "$left" "$@" \
        | grep -v '^|'  # the per-variant tables: the summary below has them all
}
want A && variant A "$text" "$dar" llama --
want B && variant B "$tripled" "$dar" llama -- --samples_per_rank
want C && variant C "$text" "$dar" -- --extra_args="--dataloader_persistent_workers true"
want D && variant D "$tripled" "$dar" llama -- --samples_per_rank --extra_args="--ddp_bucket_cap_mb 100 --ddp_broadcast_buffers false" \
    --ddp_kwargs '{"gradient_as_bucket_view": true}'
want E && variant E "$tripled" "$dar" llama -- --samples_per_rank --extra_args="--logging_nan_inf_filter false"

python3 - "$OUT" "$label" <<'EOF'
import json, sys
from pathlib import Path

out, label = Path(sys.argv[1]), sys.argv[2]
results = {f.name.split(".")[-2]: json.loads(f.read_text()) for f in sorted(out.glob(f"{label}.?.json"))}
(out / f"{label}.json").write_text(json.dumps(results, indent=1))


def row(variant, name):
    rows = [r for r in results.get(variant, {}).get("rows", []) if r["name"].startswith(name)]
    return rows[0] if rows else None


def ms(r, pick):
    values = [pick(p) for p in r.get("profile", [])] if r and r["status"] == "ok" else []
    values = [v for v in values if v is not None]
    if not values:
        return ""
    show = (lambda v: str(v)) if isinstance(values[0], int) else (lambda v: f"{v:.1f}")
    return show(values[0]) + (f" (max {show(max(values))})" if max(values) != values[0] else "")


print("| variant | dar tok/s | Llama tok/s | dar / Llama | outside steps dar / Llama | data wait mean, rank 0 (max), "
      "dar / Llama ms | data wait median dar / Llama ms | epochs begun in timed steps dar / Llama | "
      "fwd+bwd+clip GPU dar / Llama ms |")
print("| --- |" + " ---: |" * 9)
for variant in "ABCDE":
    d, l = row(variant, "dar t=2, one stream"), row(variant, "llama")
    if d is None and l is None:
        print(f"| {variant} | not run | | | | | | | |")
        continue
    llama_from = ""
    if l is None and variant == "C":
        l, llama_from = row("A", "llama"), " (A's)"
    ok = lambda r: r is not None and r["status"] == "ok"  # noqa: E731
    tok = lambda r: f"{r['tokens_per_s'] / 1e3:,.0f}k ({r['step_ms']:.1f} ms)" if ok(r) else (r or {}).get("status", "")  # noqa: E731
    share = lambda r: f"{100 * r['outside_step_share']:.1f}%" if ok(r) else ""  # noqa: E731
    ratio = f"{d['tokens_per_s'] / l['tokens_per_s']:.3f}x" if ok(d) and ok(l) else ""
    print(" | ".join([f"| {variant}", tok(d), tok(l) + llama_from, ratio, f"{share(d)} / {share(l)}",
                      f"{ms(d, lambda p: p['gap']['data_wait_ms'])} / {ms(l, lambda p: p['gap']['data_wait_ms'])}",
                      f"{ms(d, lambda p: p['data_wait']['median_ms'])} / {ms(l, lambda p: p['data_wait']['median_ms'])}",
                      f"{ms(d, lambda p: p['data_wait']['epoch_starts'])} / {ms(l, lambda p: p['data_wait']['epoch_starts'])}",
                      f"{ms(d, lambda p: p['step'].get('forward_backward_clip_ms'))} / "
                      f"{ms(l, lambda p: p['step'].get('forward_backward_clip_ms'))}"]) + " |")
print("\nlongest data waits, rank 0 (ms at step):")
for variant, result in results.items():
    for r in result["rows"]:
        if r["status"] == "ok" and r.get("profile"):
            print(f"  {variant} {r['name']}: {r['profile'][0]['data_wait']['longest_ms_at_step']}")
EOF
tail -n 25 /tmp/ddp_ab/*/*/log.txt > "$OUT/$label.logs.txt" 2>/dev/null
echo "wall ${SECONDS} s"
