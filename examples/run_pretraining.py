#!/usr/bin/env python
"""Pretrain a LookAround model with any objective, Hugging Face example style.

    python examples/run_pretraining.py \
        --train_files data/ --train_tokenizer --preset small --block_size 256 \
        --objective vmlm --mask_ratio_range 0.15 0.3 \
        --output_dir runs/vmlm --do_train --do_eval --max_steps 10000

    accelerate launch examples/run_pretraining.py ...      # several GPUs / hosts
    python examples/run_pretraining.py args.json           # arguments from a file

All of transformers' TrainingArguments work. The code lives in hf_lookaround.training.pretraining (and its options in hf_lookaround.cli.pretrain)
(`hf-lookaround pretrain` is the same job); see docs/pretraining.md.
"""

import sys

from hf_lookaround.cli.pretrain import parse_args
from hf_lookaround.training.pretraining import run


def main() -> int:
    # HfArgumentParser over (ModelArguments, DataArguments, ObjectiveArguments, TrainingArguments)
    model_args, data_args, objective_args, training_args = parse_args(sys.argv[1:])
    run(model_args, data_args, objective_args, training_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
