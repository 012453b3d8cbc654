#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (the wheel from the sdist, as `python -m build`
# does), install the wheel, not editable, into a fresh environment outside the source tree, and check that
# every source file arrived, every module imports, every command answers --help and a tiny pretrain runs.
# An editable install (make test's) reads src/ directly and would hide a folder missing from the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
root=$(pwd)
work=$(mktemp -d /tmp/hf_lookaround_install.XXXXXX)
trap 'rm -rf "$work"' EXIT

echo "== building the sdist and the wheel (from the sdist) into $work/dist"
.venv/bin/python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
ls "$work/dist"

echo "== a fresh environment, the wheel installed from outside the source tree"
$PY -m venv "$work/env"
"$work/env/bin/pip" install -q --upgrade pip
"$work/env/bin/pip" install -q "torch==2.13.0"  # the CPU build first, as make does
"$work/env/bin/pip" install -q -c constraints.txt "$work"/dist/*.whl

cd "$work"  # nothing of the checkout on sys.path from here on
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$work/env/bin/python" - "$root/src/hf_lookaround" <<'PYEOF'
import importlib, sys
from pathlib import Path

source = Path(sys.argv[1])
import hf_lookaround
installed = Path(hf_lookaround.__file__).parent
assert source.resolve() not in installed.resolve().parents and installed.resolve() != source.resolve(), installed
# every file of the source package (modules, cards, metric scripts, the remote-code bundle) is in the wheel
wanted = {p.relative_to(source) for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
missing = sorted(str(p) for p in wanted if not (installed / p).is_file())
if missing:
    sys.exit(f"{len(missing)} of {len(wanted)} files of src/hf_lookaround are missing from the wheel: {missing}")
# metric scripts are loaded by `evaluate` from their files; `__main__` runs the CLI when imported
modules = sorted(".".join(("hf_lookaround", *p.with_suffix("").parts)).removesuffix(".__init__")
                 for p in wanted if p.suffix == ".py" and p.parts[0] != "metrics" and p.stem != "__main__")
# modules of an optional extra (not installed here): they must refuse in one line that names the extra
OPTIONAL = {"hf_lookaround.evaluation.lm_eval_model": "hf-lookaround[lm-eval]"}
failed = []
for name in modules:
    try:
        importlib.import_module(name)
    except ImportError as err:
        if name not in OPTIONAL or OPTIONAL[name] not in str(err):
            failed.append(f"{name}: {type(err).__name__}: {err}")
    except Exception as err:  # noqa: BLE001 - every failure is reported, then the check fails
        failed.append(f"{name}: {type(err).__name__}: {err}")
if failed:
    sys.exit("modules that do not import from the wheel:\n  " + "\n  ".join(failed))
print(f"{len(wanted)} files present, {len(modules)} modules import from {installed}")
PYEOF

echo "== every command's --help"
commands=$("$work/env/bin/python" -c "from hf_lookaround.cli import COMMANDS; print(' '.join(COMMANDS))")
for command in $commands; do
    "$work/env/bin/hf-lookaround" "$command" --help >"$work/help.txt" 2>&1 \
        || { echo "hf-lookaround $command --help failed:"; tail -20 "$work/help.txt"; exit 1; }
    echo "  $command --help: ok"
done

echo "== a tiny pretrain from the wheel"
"$work/env/bin/python" - "$work/corpus.jsonl" <<'PYEOF'
import json, random, sys
rng = random.Random(0)
words = "the river ran past old mills where the miller kept grain and the children watched boats".split()
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(60))}) + "\n")
PYEOF
"$work/env/bin/hf-lookaround" pretrain --train_files "$work/corpus.jsonl" --train_tokenizer --tokenizer_vocab_size 300 \
    --preset tiny --block_size 32 --per_device_train_batch_size 4 --max_steps 2 --do_train --use_cpu true \
    --report_to none --disable_tqdm true --objective dar --output_dir "$work/run" >"$work/pretrain.log" 2>&1 \
    || { tail -30 "$work/pretrain.log"; exit 1; }
test -f "$work/run/model.safetensors" || { echo "pretrain wrote no model"; tail -30 "$work/pretrain.log"; exit 1; }
echo "  pretrain: ok ($(ls "$work/run" | wc -l) files in the run folder)"
echo "install check: passed"
