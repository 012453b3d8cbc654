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
# The call (back to back on one warm machine; a fresh one starts over from its carried files):
#   run(command="NGPU=4 bash benchmarks/adapt_device_call.sh", kind="nvidia-h100-x4", timeout_s=600,
#       carry=[".devdata/whl", ".devdata/c1/gutenberg"])
# First, from the checkout: mkdir -p .devdata/c1 && cp -r /work/main/.devdata/c1/gutenberg .devdata/c1/ &&
#   cp -r /work/main/.devdata/whl .devdata/   (docs/gutenberg.md makes the slice; add ".devdata/bench/tok8k_gut" to
#   carry if there is one, else an 8k BPE is trained on TRAIN first, into runs/adapt, ~1-2 min)
# Expected calls: ~860 M training tokens (source 200 M, adaptation 2 x 70 M, annealing 2 x 20 M, scratch 2 x 240 M)
# at ~0.7-1.0 M tokens/s on 4 H100s (docs/distributed.md, base size) is ~15-20 min, plus ~1 min of start-up and
# compilation for each of the 9 trainings and ~3-5 min of evaluation: 4-5 calls of 600 s on one warm machine, more
# than the 30 device minutes of one session (and a machine goes back after 30 min held, losing runs/). To fit one
# session, shrink the budgets, e.g. SOURCE_TOKENS=100000000 SCRATCH_TOKENS=120000000 SCRATCH_EVERY=20000000
# ADAPT_TOKENS="5000000 10000000 20000000" ANNEAL_TOKENS=10000000 (the 1/5 target: 20 M against 120 M).
# Each call's $OUT: adapt_*.log (every training's log); the last also adapt_bench.json and .md (copy to docs/results/).
# CPU smoke (every stage, 3b included, at tiny sizes on synthetic text; DEVICE_SMOKE=1 and the sizes of
# adapt_bench.SMOKE_RUN): PYTHONPATH=src python benchmarks/adapt_bench.py --smoke --out /tmp/adapt_smoke
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
SMOKE=${DEVICE_SMOKE:+1}  # DEVICE_SMOKE=1: CPU, fp32, eager, the tiny sizes (adapt_bench.py --smoke sets them all)
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
TRAIN=${TRAIN:-.devdata/c1/gutenberg/train.jsonl.gz}  # the slice of docs/gutenberg.md, as diffusion_device_call.sh
VALID=${VALID:-.devdata/c1/gutenberg/validation.jsonl.gz}
TOK=${TOK:-.devdata/bench/tok8k_gut}
SOURCE_TOKENS=${SOURCE_TOKENS:-200000000}
ADAPT_TOKENS=${ADAPT_TOKENS:-"10000000 20000000 40000000"}
ANNEAL_TOKENS=${ANNEAL_TOKENS:-20000000}  # one of ADAPT_TOKENS (equal tokens, equal schedule); empty: no arm
ANNEAL_SHARE=${ANNEAL_SHARE:-4}
SCRATCH_TOKENS=${SCRATCH_TOKENS:-240000000}
SCRATCH_EVERY=${SCRATCH_EVERY:-40000000}
BLOCK=${BLOCK:-512} BATCH=${BATCH:-32}
PRESET=${PRESET:-base}  # the scratch runs' size: the source Llama's (adapt_bench.py source; tiny under --smoke)
STEP_TOKENS=$((NGPU * BATCH * BLOCK))
R=${R:-runs/adapt}
if [ -n "$SMOKE" ]; then device=(--bf16 false --torch_compile false --dataloader_num_workers 0); bench=(--smoke)
else device=(--bf16 true --torch_compile true --dataloader_num_workers 2); bench=(); fi
mkdir -p "$R"
launch() { torchrun --standalone --nproc_per_node "$NGPU" "$@"; }
done_run() { [ -f "$1/final_model_complete.json" ] || [ -f "$1/source_run.json" ]; }
label() { (( $1 >= 1000000 )) && echo "$(($1 / 1000000))M" || echo "$(($1 / 1000))k"; }  # a budget's name
resume_flag() { compgen -G "$1/checkpoint-*" > /dev/null && echo "--resume_from_checkpoint last"; }
declare -A FORM=(
    [dar]="--objective dar --group_size 2 --dar_form single_stream"
    [mixture]="--objective mixture --mixture dar=0.5 vmlm=0.5 --group_size 2 --dar_form single_stream --masked_form single_stream"
)
common=(--train_files "$TRAIN" --block_size "$BLOCK" --per_device_train_batch_size "$BATCH" "${device[@]}"
        --do_train --validation_split_percentage 0 --report_to none --logging_steps 50
        --weight_decay 0.1 --adam_beta2 0.95 --max_grad_norm 1.0 --lr_scheduler_type cosine --seed 0)
echo "$NGPU GPUs, $STEP_TOKENS tokens a step"
[ -f "$TOK/tokenizer.json" ] || { TOK="$R/tok8k"; [ -f "$TOK/tokenizer.json" ] || \
    python3 -m hf_lookaround.cli train-tokenizer "$TRAIN" -o "$TOK" --vocab_size "${VOCAB:-8192}" || exit 2; }

# 1. the pretrained AR model, by plain transformers
done_run "$R/source" || launch benchmarks/adapt_bench.py source --train_file "$TRAIN" --tokenizer "$TOK" \
    --tokens "$SOURCE_TOKENS" --block_size "$BLOCK" --per_device_batch "$BATCH" --out "$R/source" "${bench[@]}" \
    2>&1 | tee -a "$OUT/adapt_source.log" | grep -E "source:|'loss'|train_runtime" | tail -5
done_run "$R/source" || { echo "source not finished: call again"; exit 3; }

# 2. convert
[ -f "$R/converted/config.json" ] || python3 -m hf_lookaround.cli convert "$R/source" -o "$R/converted" || exit 4

# 3. adapt, 4. from scratch
checkpoints=(source_llama="$R/source" converted_step0="$R/converted")
for objective in dar mixture; do
    for tokens in $ADAPT_TOKENS; do
        run="$R/${objective}_adapt_$(label "$tokens")"
        done_run "$run" || launch -m hf_lookaround.cli pretrain --init_from "$R/converted" ${FORM[$objective]} \
            "${common[@]}" --learning_rate 3e-4 --warmup_steps 50 --max_steps $((tokens / STEP_TOKENS)) \
            --save_steps 200 --save_total_limit 1 --output_dir "$run" $(resume_flag "$run") \
            > "$OUT/$(basename "$run").log" 2>&1
        done_run "$run" || { echo "$run not finished: call again"; tail -3 "$OUT/$(basename "$run").log"; exit 5; }
        checkpoints+=("$(basename "$run")=$run")
    done
    if [ -n "$ANNEAL_TOKENS" ]; then  # 3b. the same budget and schedule, annealed (row name: ..._annealed)
        steps=$((ANNEAL_TOKENS / STEP_TOKENS))
        run="$R/${objective}_adapt_$(label "$ANNEAL_TOKENS")_annealed"
        done_run "$run" || launch -m hf_lookaround.cli pretrain --init_from "$R/converted" ${FORM[$objective]} \
            "${common[@]}" --learning_rate 3e-4 --warmup_steps 50 --max_steps "$steps" \
            --attention_annealing_steps $((steps / ANNEAL_SHARE)) --save_steps 200 --save_total_limit 1 \
            --output_dir "$run" $(resume_flag "$run") > "$OUT/$(basename "$run").log" 2>&1
        done_run "$run" || { echo "$run not finished: call again"; tail -3 "$OUT/$(basename "$run").log"; exit 7; }
        checkpoints+=("$(basename "$run")=$run")
    fi
    run="$R/${objective}_scratch"
    every=$((SCRATCH_EVERY / STEP_TOKENS))
    done_run "$run" || launch -m hf_lookaround.cli pretrain --preset "$PRESET" --tokenizer_name "$TOK" \
        ${FORM[$objective]} \
        "${common[@]}" --learning_rate 6e-4 --warmup_steps 200 --max_steps $((SCRATCH_TOKENS / STEP_TOKENS)) \
        --save_steps "$every" --output_dir "$run" $(resume_flag "$run") > "$OUT/$(basename "$run").log" 2>&1
    done_run "$run" || { echo "$run not finished: call again"; tail -3 "$OUT/$(basename "$run").log"; exit 6; }
    for ckpt in "$run"/checkpoint-*; do  # the curve: every SCRATCH_EVERY tokens
        checkpoints+=("${objective}_scratch_$(label $(( ${ckpt##*-} * STEP_TOKENS )))=$ckpt")
    done
    checkpoints+=("${objective}_scratch_$(label "$SCRATCH_TOKENS")=$run")
done

# 5. evaluate every checkpoint (rows already in runs/adapt/adapt_bench.json, from an earlier call, are kept)
args=(); for c in "${checkpoints[@]}"; do args+=(--checkpoint "$c"); done
python3 benchmarks/adapt_bench.py eval --source "$R/source" --eval_file "$VALID" --out "$R/adapt_bench.json" \
    --block_size "$BLOCK" "${bench[@]}" "${args[@]}" 2>&1 | tee "$OUT/adapt_eval.log" | tail -30
cp "$R/adapt_bench.json" "$R/adapt_bench.md" "$R/source/source_run.json" "$OUT/" 2>/dev/null
