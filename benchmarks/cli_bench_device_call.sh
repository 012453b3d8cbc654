#!/usr/bin/env bash
# One GPU call of benchmarks/cli_bench.py on the project's lent machines (torch and transformers preinstalled, no
# network, no `datasets`): install the carried wheels, then run the benchmark on the carried text and tokenizer.
#   bash benchmarks/cli_bench_device_call.sh cli_bench_1 --runs ar "dar t=2" llama
set -uo pipefail
label=$1; shift
source "$(dirname "$0")/device_env.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout "${BENCH_LIMIT_S:-560}" python3 benchmarks/cli_bench.py --train_file .devdata/text/brown/train.jsonl.gz \
    --tokenizer .devdata/bench/tok32k --work_dir /tmp/cli_bench --out "$OUT/$label.json" "$@"
status=$?
tail -n 40 /tmp/cli_bench/*/log.txt > "$OUT/$label.logs.txt" 2>/dev/null
exit $status
