# Sourced by the device-call scripts: set-up on the project's lent GPU machines (torch and transformers
# preinstalled, no network, no `datasets`). Installs the carried wheels (.whl/) into /tmp/site, sets the offline
# environment, prints the card, and sets OUT (the device tool's output folder, else ./device_out). DEVICE_SMOKE=1:
# none of that but OUT and the environment (the CPU smoke runs, e.g. adapt_bench.py --smoke).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
if [ -n "${DEVICE_SMOKE:-}" ]; then  # a CPU smoke run of a device script (its Python parts in --smoke): no wheels, no card
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1
    echo "DEVICE_SMOKE: CPU, $(command -v python3)"
    return 0
fi
wheels=(.devdata/whl/*.whl); [ -e "${wheels[0]}" ] || wheels=(.whl/*.whl)  # carried wheels: .devdata/whl (study) or .whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
