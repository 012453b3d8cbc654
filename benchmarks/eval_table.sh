#!/usr/bin/env bash
# The issue-4 table at a real size: pretrain `small` AR and semi-AR (t=2) models on Brown + State of
# the Union, then
# AR perplexity, linear probes and full fine-tuning (and LoRA) on rotten_tomatoes and trec.
#   bash benchmarks/eval_table.sh DATA_DIR OUT_DIR [STEPS]
# DATA_DIR holds text/{brown,sotu} and classification/{rotten_tomatoes,trec} (../shared/data layout).
set -euo pipefail
D=$1; O=$2; STEPS=${3:-3000}
# smoke-test knobs: FT_EPOCHS, FT_MAX_TRAIN (examples per task), BF16 ("" on a CPU)
FT_EPOCHS=${FT_EPOCHS:-3}; BF16=${BF16---bf16}; FT_LIMIT=${FT_MAX_TRAIN:+--max_train_samples $FT_MAX_TRAIN}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
hf() { python3 -m hf_lookaround.cli "$@"; }
RUN_GLUE=$(cd "$(dirname "$0")/.." && pwd)/examples/run_glue.py
TRAIN="$D/text/brown/train.jsonl.gz $D/text/sotu/train.jsonl.gz"
hf train-tokenizer $TRAIN --vocab_size 8192 --output_dir $O/tokenizer
for obj in ar dar; do
  M=$O/pretrain-$obj
  hf pretrain --preset small --tokenizer_name $O/tokenizer --train_files $TRAIN \
    --validation_files $D/text/brown/validation.jsonl.gz --block_size 256 --objective $obj \
    --output_dir $M --max_steps $STEPS --per_device_train_batch_size 64 --learning_rate 1e-3 \
    --warmup_steps 200 --lr_scheduler_type cosine --weight_decay 0.01 $BF16 --logging_steps 200 \
    --do_train --do_eval --eval_strategy no --save_strategy no --report_to none --seed 0 \
    --dataloader_num_workers 2 --disable_tqdm true
  hf perplexity --model_name_or_path $M --dataset $D/text/brown --split test --protocol ar \
    --max_length 256 --stride 128 --batch_size 64 ${PPL_DOCS:+--max_documents $PPL_DOCS} --output_dir $O/ppl-$obj
  for task in rotten_tomatoes trec; do
    hf probe --model_name_or_path $M --dataset $D/classification/$task --pooling mean \
      --max_length 128 --batch_size 128 ${FT_LIMIT:+--max_train_samples $FT_MAX_TRAIN} --output_dir $O/probe-$obj-$task
    for lora in false true; do
      lr=$([ $lora = true ] && echo 1e-3 || echo 1e-4)
      python3 $RUN_GLUE --model_name_or_path $M --dataset_name $D/classification/$task \
        --use_lora $lora --max_seq_length 128 --num_train_epochs $FT_EPOCHS $FT_LIMIT --per_device_train_batch_size 32 \
        --per_device_eval_batch_size 256 --learning_rate $lr --warmup_steps 50 --weight_decay 0.01 $BF16 \
        --do_train --do_eval --do_predict --eval_strategy no --save_strategy no --report_to none --seed 0 \
        --disable_tqdm true --output_dir $O/ft-$obj-$task-lora$lora
    done
  done
done
python3 - "$O" <<'PY'
import json, sys
from pathlib import Path
O = Path(sys.argv[1])
def get(path, *keys):
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return [data.get(k) for k in keys]
print("| pretraining | brown test AR ppl | bits/byte | probe RT val/test | probe trec val/test | full FT RT val/test | full FT trec val/test | LoRA RT val/test | LoRA trec val/test |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for obj in ("ar", "dar"):
    cells = []
    ppl = get(O / f"ppl-{obj}/perplexity.json", "ar_perplexity", "bits_per_byte") or [None, None]
    cells += [f"{ppl[0]:.1f}" if ppl[0] else "-", f"{ppl[1]:.3f}" if ppl[1] else "-"]
    fmt = lambda v: "-" if v is None else f"{100 * v:.1f}"
    for task in ("rotten_tomatoes", "trec"):
        p = get(O / f"probe-{obj}-{task}/probe_results.json", "validation_accuracy", "test_accuracy") or [None, None]
        cells.append(f"{fmt(p[0])} / {fmt(p[1])}")
    for lora in ("false", "true"):
        for task in ("rotten_tomatoes", "trec"):
            r = get(O / f"ft-{obj}-{task}-lora{lora}/all_results.json", "eval_accuracy", "predict_accuracy") or [None, None]
            cells.append(f"{fmt(r[0])} / {fmt(r[1])}")
    print(f"| {obj} | " + " | ".join(cells) + " |")
PY
