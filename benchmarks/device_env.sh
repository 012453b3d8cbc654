# Sourced by every device-call script (benchmarks/*_device_call.sh, study/*_device_call.sh): the set-up of the
# project's lent GPU machines (torch 2.11 and transformers 5.17 preinstalled, no network, no `datasets` or
# `evaluate`: their wheels are carried), here and nowhere else. The scripts and their `carry` lists:
# docs/benchmarks.md#device-scripts. It
#   - moves to the repository root and sets OUT (the device tool's output folder, else ./device_out);
#   - keeps NVLink multicast off in NCCL, PyTorch and NVSHMEM (the workplace's rule for its multi-GPU hosts: a
#     program that uses it can take the shared GPUs out of service);
#   - installs the carried wheels (.devdata/whl/*.whl, else .whl/*.whl) into /tmp/site, exports
#     PYTHONPATH=/tmp/site:src and the offline environment, and prints the card.
# DEVICE_SMOKE=1 (a CPU smoke run of a script, its Python parts in --smoke): OUT and the environment only, with the
# caller's python3 (no wheels, no card).
# What several scripts share beyond that is defined here too: mps_start / mps_stop, c1_aux_data.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# CUDA MPS, so that the study's cells sharing a GPU run their small kernels side by side (STUDY_MPS=0: off). MPS is
# kept only if a CUDA process still works under it.
mps_start() {
    if [ "${STUDY_MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null; then
        if python3 -c "import torch; x = torch.ones(4, device='cuda'); assert float(x.sum()) == 4" 2>/dev/null; then
            echo "MPS: on"
        else
            echo quit | nvidia-cuda-mps-control; echo "MPS: failed a CUDA check, off"
        fi
    else
        echo "MPS: off"
    fi
}
mps_stop() { echo quit | nvidia-cuda-mps-control 2>/dev/null; }

# The C1 study's evaluation data (text/{sotu,brown}/test, classification/<task>/, bbcnews/data/), carried as
# .devdata/c1/aux.tgz, unpacked into /tmp/c1data.
c1_aux_data() { mkdir -p /tmp/c1data && tar -xzf .devdata/c1/aux.tgz -C /tmp/c1data; }

if [ -n "${DEVICE_SMOKE:-}" ]; then
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    echo "DEVICE_SMOKE: CPU, $(command -v python3)"
    return 0
fi
wheels=(.devdata/whl/*.whl); [ -e "${wheels[0]}" ] || wheels=(.whl/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
