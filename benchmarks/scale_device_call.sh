#!/usr/bin/env bash
# Issue 41, one call on a host of 4 GPUs (about 9 minutes; the whole call is held under 540 s):
#   run(kind="nvidia-h100-x4", timeout_s=600, command="bash benchmarks/scale_device_call.sh scale41",
#       carry=[".devdata/whl", ".devdata/bench", ".devdata/text/brown"])
# .devdata (git-ignored) as docs/benchmarks.md builds it: .devdata/whl = the wheels of datasets 5.2.0, evaluate 0.4.6,
# multiprocess 0.70.19 (py312), dill 0.4.1 and fsspec 2026.9.0; .devdata/bench/tok32k = `hf-lookaround
# train-tokenizer brown/train.jsonl.gz -o tok32k --vocab_size 32000`; .devdata/text/brown/train.jsonl.gz = the Brown
# corpus's train split.
#
# What it runs, through benchmarks/cli_bench.py (`base`, bf16, compile, 16 x 1024 positions per GPU per step, 10
# warm-up and 25 timed steps), in this order, each with the run_clm-style Llama under the same strategy:
#   1. one process: one-stream dar t = 2, Llama, the one-stream mixture (dar + vmlm), side by side on GPUs 0, 1, 2;
#   2. accelerate launch, examples/accelerate/ddp.yaml, 4 processes: the same three, one after the other;
#   3. accelerate launch, examples/accelerate/fsdp.yaml, 4 processes: the same three (Llama wrapped by
#      LlamaDecoderLayer, every other setting of fsdp.yaml).
# 1 and 2 carry --profile: 3 more steps after the timed ones under torch.profiler, and per-rank timers on the timed
# steps (benchmarks/step_profile.py). It prints cli_bench's tables (tokens/s, ratio to Llama under the same launcher,
# scaling from one process, share outside steps) and the profile table. A run that cannot finish before the budget is
# marked "skipped" (rerun those with SCALE_LAUNCH, e.g. SCALE_LAUNCH="fsdp:4"). Writes $OUT/LABEL.json and LABEL.logs.txt.
set -uo pipefail
label=${1:-scale41}
source "$(dirname "$0")/device_env.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
budget=${SCALE_BUDGET_S:-535}
python3 -c 'import torch; print("GPUs:", torch.cuda.device_count(), "torch", torch.__version__)'
timeout $((budget - SECONDS + 5)) python3 benchmarks/cli_bench.py --train_file .devdata/text/brown/train.jsonl.gz \
    --tokenizer .devdata/bench/tok32k --work_dir /tmp/scale --out "$OUT/$label.json" \
    --runs "dar t=2, one stream" llama "mixture dar+vmlm, one stream" \
    --launch ${SCALE_LAUNCH:-none ddp:4 fsdp:4} --side_by_side --profile none ddp:4 --profile_steps 3 \
    --warmup_steps 10 --timed_steps 25 --timeout_s 170 --expected_run_s 75 --deadline_s $((budget - SECONDS - 5))
status=$?
tail -n 25 /tmp/scale/*/log.txt > "$OUT/$label.logs.txt" 2>/dev/null
echo "wall ${SECONDS} s, exit $status"
exit $status
