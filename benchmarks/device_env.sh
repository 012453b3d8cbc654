# Sourced by the device-call scripts: set-up on the project's lent GPU machines (torch and transformers
# preinstalled, no network, no `datasets`). Installs the carried wheels (.whl/) into /tmp/site, sets the offline
# environment, prints the card, and sets OUT (the device tool's output folder, else ./device_out).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
wheels=(.devdata/whl/*.whl); [ -e "${wheels[0]}" ] || wheels=(.whl/*.whl)  # carried wheels: .devdata/whl (study) or .whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
