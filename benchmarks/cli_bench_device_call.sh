#!/usr/bin/env bash
# One GPU call of benchmarks/cli_bench.py on the project's lent machines (torch and transformers preinstalled, no
# network, no `datasets`): install the carried wheels, then run the benchmark on the carried text and tokenizer.
#   bash benchmarks/cli_bench_device_call.sh cli_bench_1 --runs ar "dar t=2" llama
# On a machine of several GPUs, groups of runs separated by "::" run side by side, one group per GPU, each
# with its family's baseline on the same GPU (every ratio is taken on one GPU); the tables follow, one per GPU:
#   bash benchmarks/cli_bench_device_call.sh cli_bench_8 ar llama :: "dar t=2" llama :: mlm bert :: gvp xlnet
set -uo pipefail
label=$1; shift
source "$(dirname "$0")/device_env.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
bench() {  # bench OUT_JSON WORK_DIR ARGS...
    local out=$1 work=$2; shift 2
    timeout "${BENCH_LIMIT_S:-560}" python3 benchmarks/cli_bench.py --train_file .devdata/text/brown/train.jsonl.gz \
        --tokenizer .devdata/bench/tok32k --work_dir "$work" --out "$out" "$@"
}
if [[ " $* " != *" :: "* ]]; then
    bench "$OUT/$label.json" /tmp/cli_bench "$@"
    status=$?
    tail -n 40 /tmp/cli_bench/*/log.txt > "$OUT/$label.logs.txt" 2>/dev/null
    exit $status
fi
groups=() group=()
for arg in "$@"; do
    if [[ $arg == "::" ]]; then groups+=("$(printf '%q ' "${group[@]}")"); group=(); else group+=("$arg"); fi
done
groups+=("$(printf '%q ' "${group[@]}")")
pids=()
for i in "${!groups[@]}"; do
    eval "runs=(${groups[$i]})"
    CUDA_VISIBLE_DEVICES=$i bench "$OUT/$label.gpu$i.json" "/tmp/cli_bench$i" --runs "${runs[@]}" \
        > "/tmp/cli_bench_gpu$i.txt" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
tail -n 30 /tmp/cli_bench_gpu*.txt /tmp/cli_bench*/*/log.txt > "$OUT/$label.logs.txt" 2>/dev/null  # 8 files come back
python3 benchmarks/cli_bench.py --report "$OUT/$label".gpu*.json
exit $status
