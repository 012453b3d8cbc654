#!/usr/bin/env bash
# Issue 39's headline on a lent multi-GPU machine (torch and transformers preinstalled, no network): does adapting a
# pretrained causal LM match training from scratch with at most 1/5 of the tokens? One call runs every stage:
#   1. source:  a run_clm-style LlamaForCausalLM of the `base` size, plain transformers Trainer (DDP), SOURCE_TOKENS
#   2. convert: hf-lookaround convert (the LookAround checkpoint with the source's logits)
#   3. adapt:   one-stream dar (t = 2) and the one-stream dar+vmlm mixture, --init_from the conversion, one run per
#               budget in ADAPT_TOKENS (cosine schedule each, as a run of that length would be)
#   3b. anneal: the ANNEAL_TOKENS budget of 3. again with DiffuLLaMA's attention-mask annealing
#               (--attention_annealing_steps: the first 1/ANNEAL_SHARE of its steps move the mask from causal to the
#               objective's); its row against the plain run of the same budget says whether annealing helps
#   4. scratch: the same objectives from random weights for SCRATCH_TOKENS, a checkpoint every SCRATCH_EVERY (the curve)
#   5. eval:    AR ppl, semi-AR (t = 2) ppl, generative ppl of 128-token continuations decoded 2 tokens a forward
#               and scored by the source, new tokens/s -> $OUT/adapt_bench.json and .md (copy to docs/results/)
# A stage whose output is complete is skipped and a cut-off training resumes from its last checkpoint, so under a
# per-call time limit the same call, repeated, finishes the measurement (runs/ stays on a warm machine).
# carry: .devdata/whl .devdata/gutenberg/train.jsonl.gz .devdata/gutenberg/validation.jsonl.gz (docs/gutenberg.md makes
# the slice) and .devdata/bench/tok8k_gut if there is one (else an 8k BPE is trained on TRAIN first, into runs/adapt)
#   NGPU=4 bash benchmarks/adapt_device_call.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
TRAIN=${TRAIN:-.devdata/gutenberg/train.jsonl.gz}
VALID=${VALID:-.devdata/gutenberg/validation.jsonl.gz}
TOK=${TOK:-.devdata/bench/tok8k_gut}
SOURCE_TOKENS=${SOURCE_TOKENS:-200000000}
ADAPT_TOKENS=${ADAPT_TOKENS:-"10000000 20000000 40000000"}
ANNEAL_TOKENS=${ANNEAL_TOKENS:-20000000}  # one of ADAPT_TOKENS (equal tokens, equal schedule); empty: no arm
ANNEAL_SHARE=${ANNEAL_SHARE:-4}
SCRATCH_TOKENS=${SCRATCH_TOKENS:-240000000}
SCRATCH_EVERY=${SCRATCH_EVERY:-40000000}
BLOCK=512 BATCH=${BATCH:-32}
STEP_TOKENS=$((NGPU * BATCH * BLOCK))
R=runs/adapt
mkdir -p "$R"
launch() { torchrun --standalone --nproc_per_node "$NGPU" "$@"; }
done_run() { [ -f "$1/final_model_complete.json" ] || [ -f "$1/source_run.json" ]; }
resume_flag() { compgen -G "$1/checkpoint-*" > /dev/null && echo "--resume_from_checkpoint last"; }
declare -A FORM=(
    [dar]="--objective dar --group_size 2 --dar_form single_stream"
    [mixture]="--objective mixture --mixture dar=0.5 vmlm=0.5 --group_size 2 --dar_form single_stream --masked_form single_stream"
)
common=(--train_files "$TRAIN" --block_size "$BLOCK" --per_device_train_batch_size "$BATCH" --bf16 true
        --torch_compile true --do_train --validation_split_percentage 0 --report_to none --logging_steps 50
        --weight_decay 0.1 --adam_beta2 0.95 --max_grad_norm 1.0 --lr_scheduler_type cosine --seed 0
        --dataloader_num_workers 2)
echo "$NGPU GPUs, $STEP_TOKENS tokens a step"
[ -f "$TOK/tokenizer.json" ] || { TOK="$R/tok8k"; [ -f "$TOK/tokenizer.json" ] || \
    python3 -m hf_lookaround.cli train-tokenizer "$TRAIN" -o "$TOK" --vocab_size 8192 || exit 2; }

# 1. the pretrained AR model, by plain transformers
done_run "$R/source" || launch benchmarks/adapt_bench.py source --train_file "$TRAIN" --tokenizer "$TOK" \
    --tokens "$SOURCE_TOKENS" --block_size "$BLOCK" --per_device_batch "$BATCH" --out "$R/source" \
    2>&1 | tee -a "$OUT/adapt_source.log" | grep -E "source:|'loss'|train_runtime" | tail -5
done_run "$R/source" || { echo "source not finished: call again"; exit 3; }

# 2. convert
[ -f "$R/converted/config.json" ] || python3 -m hf_lookaround.cli convert "$R/source" -o "$R/converted" || exit 4

# 3. adapt, 4. from scratch
checkpoints=(source_llama="$R/source" converted_step0="$R/converted")
for objective in dar mixture; do
    for tokens in $ADAPT_TOKENS; do
        run="$R/${objective}_adapt_$((tokens / 1000000))M"
        done_run "$run" || launch -m hf_lookaround.cli pretrain --init_from "$R/converted" ${FORM[$objective]} \
            "${common[@]}" --learning_rate 3e-4 --warmup_steps 50 --max_steps $((tokens / STEP_TOKENS)) \
            --save_steps 200 --save_total_limit 1 --output_dir "$run" $(resume_flag "$run") \
            > "$OUT/$(basename "$run").log" 2>&1
        done_run "$run" || { echo "$run not finished: call again"; tail -3 "$OUT/$(basename "$run").log"; exit 5; }
        checkpoints+=("${objective}_adapt_$((tokens / 1000000))M=$run")
    done
    if [ -n "$ANNEAL_TOKENS" ]; then  # 3b. the same budget and schedule, annealed (row name: ..._annealed)
        steps=$((ANNEAL_TOKENS / STEP_TOKENS))
        run="$R/${objective}_adapt_$((ANNEAL_TOKENS / 1000000))M_annealed"
        done_run "$run" || launch -m hf_lookaround.cli pretrain --init_from "$R/converted" ${FORM[$objective]} \
            "${common[@]}" --learning_rate 3e-4 --warmup_steps 50 --max_steps "$steps" \
            --attention_annealing_steps $((steps / ANNEAL_SHARE)) --save_steps 200 --save_total_limit 1 \
            --output_dir "$run" $(resume_flag "$run") > "$OUT/$(basename "$run").log" 2>&1
        done_run "$run" || { echo "$run not finished: call again"; tail -3 "$OUT/$(basename "$run").log"; exit 7; }
        checkpoints+=("$(basename "$run")=$run")
    fi
    run="$R/${objective}_scratch"
    every=$((SCRATCH_EVERY / STEP_TOKENS))
    done_run "$run" || launch -m hf_lookaround.cli pretrain --preset base --tokenizer_name "$TOK" ${FORM[$objective]} \
        "${common[@]}" --learning_rate 6e-4 --warmup_steps 200 --max_steps $((SCRATCH_TOKENS / STEP_TOKENS)) \
        --save_steps "$every" --output_dir "$run" $(resume_flag "$run") > "$OUT/$(basename "$run").log" 2>&1
    done_run "$run" || { echo "$run not finished: call again"; tail -3 "$OUT/$(basename "$run").log"; exit 6; }
    for ckpt in "$run"/checkpoint-*; do  # the curve: every SCRATCH_EVERY tokens
        checkpoints+=("${objective}_scratch_$(( ${ckpt##*-} * STEP_TOKENS / 1000000 ))M=$ckpt")
    done
    checkpoints+=("${objective}_scratch_$((SCRATCH_TOKENS / 1000000))M=$run")
done

# 5. evaluate every checkpoint (rows already in runs/adapt/adapt_bench.json, from an earlier call, are kept)
args=(); for c in "${checkpoints[@]}"; do args+=(--checkpoint "$c"); done
python3 benchmarks/adapt_bench.py eval --source "$R/source" --eval_file "$VALID" --out "$R/adapt_bench.json" \
    "${args[@]}" 2>&1 | tee "$OUT/adapt_eval.log" | tail -30
cp "$R/adapt_bench.json" "$R/adapt_bench.md" "$R/source/source_run.json" "$OUT/" 2>/dev/null
