#!/usr/bin/env bash
# One GPU call of the study, as run on the project's lent H100 machines (torch and transformers preinstalled,
# no network): install the carried wheels, try CUDA MPS so that the cells sharing a GPU run their small kernels
# side by side, then run study/study.py with the arguments given. Results go to $OUT/study (a bundle).
#   bash study/study_device_call.sh --sweep --run_label sweep1 --cells_per_gpu 12 --max_minutes 8
set -uo pipefail
source "$(dirname "$0")/../benchmarks/device_env.sh"  # sets up the lent machine, cd to the repository root
mps_start
python3 study/study.py --corpus_dir .studydata/gutenberg --data_root .devdata \
    --results_dir docs/results/study18 --copy_to "$OUT/study" "$@"
status=$?
mps_stop
exit $status
