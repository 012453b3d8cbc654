#!/usr/bin/env bash
# Issue 40's GPU benchmark (benchmarks/diffusion_bench.py) as one call on a lent 4-GPU machine; 2-3 calls finish it
# (7 cells x 3 seeds = 21 trainings, ~14 min at eight at a time, then ~5 min of decoding on one GPU):
#   run(command="bash benchmarks/diffusion_device_call.sh", kind="nvidia-h100-x4", timeout_s=590,
#       carry=[".devdata/c1/gutenberg", ".devdata/whl", ".devdata/diffbench"])
# The cells: ar, dar-t2-1s, mdlm, bd3lm-b4, bd3lm-b16, bd3lm-b4-1s (BD3-LM's one-stream form), vmlm; fewer with
# e.g. --cells ar bd3lm-b4 mdlm (the decoding job needs ar and bd3lm-b4, and bd3lm-b4-1s when it is listed).
# Carried (git-ignored; copy them from /work/main/.devdata before the first call):
#   .devdata/c1/gutenberg/{train,test}.jsonl.gz   the Gutenberg slice of docs/gutenberg.md (train sha256 c10faa1c...)
#   .devdata/whl/*.whl                             datasets and the packages it needs beyond the machine's image
#   .devdata/diffbench/                            the records of earlier calls (absent on the first call: fine)
# After each call copy its records back, then call again until it prints "missing after this call: none; decoding
# done" (back to back: a warm machine keeps runs/diffbench, so a cut cell continues from its last checkpoint and
# the decoding job finds its two models; a fresh machine retrains those two before decoding):
#   mkdir -p .devdata/diffbench && cp -rf FILES_AT/diffbench/. .devdata/diffbench/ && chmod -R u+w .devdata/diffbench
# and at the end the report from the records alone (the numbers belong in docs/results/):
#   python benchmarks/diffusion_bench.py --report .devdata/diffbench --out docs/results/diffusion_bench
# First call, from the checkout:
#   mkdir -p .devdata/c1 && cp -r /work/main/.devdata/c1/gutenberg .devdata/c1/ && cp -r /work/main/.devdata/whl .devdata/
# Writes $OUT/diffbench/{diffusion_bench.md,diffusion_bench.json,cells/,
# decoding.json} (rewritten after every job) and $OUT/diffbench/logs.txt (the tails of every job's log).
# Extra arguments go to diffusion_bench.py (e.g. --seeds 0 1 2 3, --tokens 20000000, --minutes 8.5).
# CPU smoke of this script (no wheels, no card; diffusion_bench's tiny sizes and synthetic text):
#   DEVICE_SMOKE=1 OUT=/tmp/dd bash benchmarks/diffusion_device_call.sh --smoke (python3 on PATH: the project's venv)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p "$OUT/diffbench"
timeout "${LIMIT_S:-570}" python3 benchmarks/diffusion_bench.py --out "$OUT/diffbench" --work_dir runs/diffbench \
    --corpus_dir .devdata/c1/gutenberg --records_from .devdata/diffbench --minutes "${MINUTES:-8.8}" "$@" \
    2>&1 | tee "$OUT/diffbench/driver_log.txt"
status=${PIPESTATUS[0]}
for log in runs/diffbench/cells/*/log.txt runs/diffbench/*/job_log.txt; do
    [ -f "$log" ] && { echo "== $log"; tail -n 12 "$log"; }
done > "$OUT/diffbench/logs.txt" 2>/dev/null
df -h . | tail -1
exit "$status"
