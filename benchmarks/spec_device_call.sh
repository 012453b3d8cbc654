#!/usr/bin/env bash
# Issue 33's self-speculative decoding on one lent GPU, one call: train a `small` dar checkpoint with t = 1 and 2
# (drafts need t = 2, verification t = 1) on a 30 MB Gutenberg slice, then decode_bench on it (64-token prompts
# from held-out books, greedy) and on the `base` preset with random weights: compiled t = 1 against compiled
# speculative k = 2 with its fallback, without it, and always falling back (the schedule zero acceptance gets).
# carry: .devdata/whl .devdata/bench .devdata/gutenberg/validation.jsonl.gz
#   STEPS=3000 bash benchmarks/spec_device_call.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
decoders=("group t=1 (static+compile)" "speculative k=2 (static+compile)"
          "speculative k=2, no fallback (static+compile)" "speculative k=2, always falls back (static+compile)")
start=$SECONDS
timeout "${TRAIN_LIMIT_S:-240}" python3 -m hf_lookaround.cli pretrain --train_files .devdata/bench/gut30m.jsonl.gz \
    --tokenizer_name .devdata/bench/tok8k_gut --preset small --objective dar --group_size 1 2 --block_size 512 \
    --per_device_train_batch_size 32 --learning_rate 1e-3 --warmup_steps 200 --max_steps "${STEPS:-3000}" \
    --do_train --validation_split_percentage 0 --save_strategy no --report_to none --logging_steps 250 --seed 0 \
    --bf16 true --torch_compile true --output_dir runs/dar12 --overwrite_output_dir true \
    > "$OUT/spec_train.log" 2>&1
rc=$?; echo "trained in $((SECONDS - start)) s (rc $rc)"; grep -E "'loss'|train_runtime" "$OUT/spec_train.log" | tail -4
python3 - <<'PY'
import gzip, json
docs = [json.loads(line)["text"] for line in gzip.open(".devdata/gutenberg/validation.jsonl.gz", "rt")]
lines = [" ".join(d[5000 + 400 * i : 5300 + 400 * i].split()) for d in docs[:4] for i in range(4)]
open("/tmp/prompts.txt", "w").write("\n".join(lines) + "\n")
PY
timeout "${TRAINED_LIMIT_S:-200}" python3 benchmarks/decode_bench.py --checkpoint runs/dar12 --prompts /tmp/prompts.txt \
    --new_tokens 128 --repeats 3 --output "$OUT/decode_spec_trained.json" --decoders "${decoders[@]}"
timeout "${BASE_LIMIT_S:-200}" python3 benchmarks/decode_bench.py --preset base --new_tokens 128 --repeats 3 \
    --output "$OUT/decode_spec_base.json" --decoders "${decoders[@]}"
