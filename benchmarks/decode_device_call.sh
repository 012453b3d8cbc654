#!/usr/bin/env bash
# The decoding benchmarks of issue 19 on the project's lent GPU machines (torch and transformers preinstalled,
# no network): the carried wheels are installed, the corpus is read from the carried .devdata/ folder.
#   bash benchmarks/decode_device_call.sh quality   # generation_bench: trains dar{1,2,4}, ar and a larger AR scorer
#   bash benchmarks/decode_device_call.sh speed     # decode_bench on that dar checkpoint, then the base preset
#   bash benchmarks/decode_device_call.sh batch8 [small]  # base (or small), batch 8 (random weights: speed does not
#       depend on them):
#       compiled t=2 against compiled t=1 and Llama in bf16; whether the compiled and speculative decoders give
#       t=1's tokens in float32 (in bf16 near-ties of the argmax differ)
# Both write under $OUT (the device tool's output folder) or ./device_out; checkpoints go to runs/ (kept on a warm
# machine between the two calls).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
case "$1" in
  quality)
    shift
    timeout "${LIMIT_S:-570}" python3 benchmarks/generation_bench.py --data .devdata/gutenberg/train.jsonl.gz \
        --eval_data .devdata/gutenberg/validation.jsonl.gz --checkpoint_dir runs/generation_bench \
        --out "$OUT/generation_bench.json" "$@" 2>&1 | tee "$OUT/generation_bench.log" ;;
  speed)
    shift
    # prompts: 300 characters from 4 places (past the first 5,000) of each of 4 held-out books, one per line
    python3 - <<'PY'
import gzip, json
docs = [json.loads(line)["text"] for line in gzip.open(".devdata/gutenberg/validation.jsonl.gz", "rt")]
lines = [" ".join(d[5000 + 400 * i : 5300 + 400 * i].split()) for d in docs[:4] for i in range(4)]
open("/tmp/prompts.txt", "w").write("\n".join(lines) + "\n")
PY
    timeout "${LIMIT_S:-300}" python3 benchmarks/decode_bench.py --checkpoint runs/generation_bench/dar \
        --prompts /tmp/prompts.txt --new_tokens 128 --output "$OUT/decode_bench_trained.json" "$@"
    timeout 240 python3 benchmarks/decode_bench.py --preset base --new_tokens 128 --output "$OUT/decode_bench_base.json" \
        --decoders "group t=1 (static+compile)" "group t=2 (static+compile)" "group t=4 (static+compile)" \
        "generate() static+compile" "Llama generate() static+compile" ;;
  batch8)
    preset=${2:-base}
    timeout 260 python3 benchmarks/decode_bench.py --preset "$preset" --batch_sizes 8 --new_tokens 128 \
        --output "$OUT/decode_bench_${preset}_b8.json" \
        --decoders "group t=1 (static+compile)" "group t=2 (static+compile)" "Llama generate() static+compile"
    timeout 260 python3 benchmarks/decode_bench.py --preset "$preset" --batch_sizes 8 --new_tokens 64 --dtype float32 \
        --repeats 1 --output "$OUT/decode_bench_${preset}_b8_fp32.json" \
        --decoders "group t=1 (static+compile)" "generate() static+compile" "speculative k=2" \
        "speculative k=2 (static+compile)" ;;
  *) echo "usage: $0 quality|speed|batch8 [benchmark flags]"; exit 2 ;;
esac
