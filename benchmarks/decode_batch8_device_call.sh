#!/usr/bin/env bash
# Issue 19's two open measurements at batch 8 on one lent GPU, on the untrained `base` preset (speed does not
# depend on the weights): compiled group decoding t=2 against compiled t=1 and compiled Llama in bf16, and whether
# the compiled and speculative decoders give t=1's tokens in float32 (in bf16 near-ties of the argmax differ).
#   bash benchmarks/decode_batch8_device_call.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 260 python3 benchmarks/decode_bench.py --preset base --batch_sizes 8 --new_tokens 128 \
    --output "$OUT/decode_bench_base_b8.json" \
    --decoders "group t=1 (static+compile)" "group t=2 (static+compile)" "Llama generate() static+compile"
timeout 260 python3 benchmarks/decode_bench.py --preset base --batch_sizes 8 --new_tokens 64 --dtype float32 \
    --repeats 1 --output "$OUT/decode_bench_base_b8_fp32.json" \
    --decoders "group t=1 (static+compile)" "generate() static+compile" "speculative k=2" "speculative k=2 (static+compile)"
