#!/usr/bin/env bash
# Issue 33's "one compiled graph per run, on any data": cli_bench's recompiles after warm-up for an objective whose
# kept width depends on the batch (vmlm drops its unread content by default), on two corpora: Brown (the text the
# earlier cli_bench calls used) and a Gutenberg slice cli_bench never saw. One GPU, one `run`:
#   bash benchmarks/recompile_check_device_call.sh "vmlm [0.15, 0.3]"
#   CORPORA=gutenberg:.devdata/gutenberg/validation.jsonl.gz bash benchmarks/recompile_check_device_call.sh gvp
# carry: .devdata/whl .devdata/bench .devdata/text/brown .devdata/gutenberg/validation.jsonl.gz
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
status=0
# CORPORA="gutenberg" checks the unseen corpus alone (after a cli_bench call on Brown)
for corpus in ${CORPORA:-brown:.devdata/text/brown/train.jsonl.gz gutenberg:.devdata/gutenberg/validation.jsonl.gz}; do
    name=${corpus%%:*}
    timeout "${RUN_LIMIT_S:-120}" python3 benchmarks/cli_bench.py --train_file "${corpus#*:}" --tokenizer .devdata/bench/tok32k \
        --work_dir "/tmp/recompile_$name" --out "$OUT/recompile_$name.json" --runs "$@" \
        --warmup_steps 15 --timed_steps 20 --timeout_s "${RUN_LIMIT_S:-120}" || status=1
done
python3 benchmarks/cli_bench.py --report "$OUT"/recompile_*.json
exit $status
