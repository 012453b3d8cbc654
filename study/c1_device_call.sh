#!/usr/bin/env bash
# One device command of the C1 grid (issue 42, study/study_protocol_c1.json) on a lent 4-GPU machine.
# Before the first command, on the development machine with a clean tree (the stamp lists every tracked file's
# blob SHA-1; this script's `run` refuses a tree that differs, before any cell):
#   python study/study_curves.py preflight --protocol study/study_protocol_c1.json --stamp .devdata/c1/code_commit.json
# Carried (git-ignored): .devdata/c1 (gutenberg/, aux.tgz, code_commit.json) and .devdata/whl, as for
# study/finetune_timing_device_call.sh. Usage (one `run` call per command, kind nvidia-h100-x4, the next within 30 s):
#   bash study/c1_device_call.sh 1 c1p1c1
#   bash study/c1_device_call.sh 1 c1p1c2                 # resumes c1p1c1's cells from the machine's disk
#   bash study/c1_device_call.sh 1 c1p1c3 --finished_from .devdata/c1/bundles/*.json.gz   # after a lost machine
#   bash study/c1_device_call.sh 2 c1p2c1 --with_optional # the mixture (budget.mixture_rule)
# Each task's three fine-tuning rates run at once, one process each (RATE_PROCESSES, default 3; the scores do not
# depend on it: study/tests/test_study_c1.py). A cell starts its evaluation only if 1.2 x EVAL_MINUTES_GUESS (default 1;
# the C1 probes took 25-34 s) fits before the deadline. The bundle of every record so far: $OUT/curves__part<P>__<label>.json.gz
set -uo pipefail
PART=$1; LABEL=$2; shift 2
source "$(dirname "$0")/../benchmarks/device_env.sh"  # sets up the lent machine, cd to the repository root
c1_aux_data || exit 1
mps_start
# records and checkpoints live on the machine's disk (outputs/c1), kept while the machine stays warm
python3 study/study_curves.py run --protocol study/study_protocol_c1.json --stamp .devdata/c1/code_commit.json \
    --part "$PART" --command_label "$LABEL" --minutes "${MINUTES:-9}" --bundle_dir "$OUT" --rate_processes "${RATE_PROCESSES:-3}" --eval_minutes_guess "${EVAL_MINUTES_GUESS:-1}" \
    --records_dir outputs/c1/records --work_dir outputs/c1/work \
    --corpus_dir .devdata/c1/gutenberg --data_root /tmp/c1data --bbc_dir /tmp/c1data/bbcnews/data "$@"
status=$?
mps_stop
df -h . | tail -1; du -sh outputs/c1 2>/dev/null
exit $status
