"""``hf-lookaround glue``: GLUE-style fine-tuning, full or LoRA (the options of ``run_glue.py``)."""

from __future__ import annotations

import logging
import os
import sys

from ..evaluation.glue import DataTrainingArguments, ModelArguments, run


def parse_args(argv: list[str] | None = None):
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    run(*parse_args(argv))
    return 0
