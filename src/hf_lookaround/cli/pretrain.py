"""``hf-lookaround pretrain``: pretrain with ``Trainer`` on local files or a ``datasets`` name (the options of
``run_clm.py``, as argument dataclasses, plus the objective's)."""

from __future__ import annotations

import logging
import os
import sys

from transformers import HfArgumentParser

from ..training.pretraining import (
    DataArguments,
    LookAroundTrainingArguments,
    ModelArguments,
    ObjectiveArguments,
    run,
)


def parse_args(argv: list[str] | None = None):
    parser = HfArgumentParser((ModelArguments, DataArguments, ObjectiveArguments, LookAroundTrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    if not any(a == "--report_to" or a.startswith("--report_to=") for a in argv):
        argv += ["--report_to", "tensorboard"]  # TensorBoard logs under output_dir/runs by default
    if not any(a.split("=")[0] in ("--do_train", "--do_eval", "--do_predict") for a in argv):
        argv += ["--do_train", "--do_eval"]  # a pretraining command that names no stage trains and evaluates
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    run(*parse_args(argv))
    return 0
