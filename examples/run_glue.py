#!/usr/bin/env python
"""Fine-tune a checkpoint on a GLUE task or a local sentence (pair) classification / regression data set.

In the manner of transformers' examples/pytorch/text-classification/run_glue.py; the code lives in
``hf_lookaround.evaluation.glue`` (also ``hf-lookaround glue``). Every ``TrainingArguments`` option works.

    # a GLUE task (needs a network for nyu-mll/glue)
    python examples/run_glue.py --model_name_or_path CKPT --task_name sst2 --do_train --do_eval --output_dir out

    # local files, offline; LoRA through peft
    HF_HUB_OFFLINE=1 python examples/run_glue.py --model_name_or_path CKPT \
        --train_file ../shared/data/classification/rotten_tomatoes/train.jsonl \
        --validation_file ../shared/data/classification/rotten_tomatoes/validation.jsonl \
        --use_lora --lora_r 8 --do_train --do_eval --num_train_epochs 3 --output_dir out

Results go to ``out/all_results.json`` (``train_*`` and ``eval_*`` keys).
"""

import sys

from hf_lookaround.evaluation.glue import main

if __name__ == "__main__":
    sys.exit(main())
