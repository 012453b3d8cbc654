#!/usr/bin/env bash
# One GPU call of benchmarks/cli_bench.py on the project's lent machines (torch and transformers preinstalled, no
# network, no `datasets`): install the carried wheels, then run the benchmark on the carried text and tokenizer.
#   bash benchmarks/cli_bench_device_call.sh cli_bench_1 --runs ar "dar t=2" llama
set -uo pipefail
cd "$(dirname "$0")/.."
label=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${BENCH_LIMIT_S:-560}" python3 benchmarks/cli_bench.py --train_file .devdata/text/brown/train.jsonl.gz \
    --tokenizer .devdata/bench/tok32k --work_dir /tmp/cli_bench --out "$OUT/$label.json" "$@"
status=$?
tail -n 40 /tmp/cli_bench/*/log.txt > "$OUT/$label.logs.txt" 2>/dev/null
exit $status
