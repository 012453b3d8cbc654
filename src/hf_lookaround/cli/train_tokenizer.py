"""``hf-lookaround train-tokenizer``: train a byte-level BPE tokenizer on local text or a ``datasets`` name."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data.text import iter_texts
from ..data.tokenization import check_tokenizer_settings, tokenizer_files, train_tokenizer
from ..training.checkpointing import OutputDirLock

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround train-tokenizer",
        description="Train a byte-level BPE tokenizer on local text files/folders (.txt, .jsonl, .json, .gz, .parquet) "
        "or a `datasets` name, and save it for AutoTokenizer.from_pretrained.",
    )
    parser.add_argument("inputs", nargs="+", help="files, folders or a datasets name (e.g. wikitext:wikitext-2-raw-v1)")
    parser.add_argument("--output_dir", "-o", required=True)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--min_frequency", type=int, default=2)
    parser.add_argument("--text_column", default="text", help="field of JSON Lines records / dataset column")
    parser.add_argument("--split", default="train", help="split to read when an input is a datasets name")
    parser.add_argument("--model_max_length", type=int, default=None)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the tokenizer that --output_dir already holds (without this, it is refused)")
    args = parser.parse_args(argv)

    check_tokenizer_settings(args.vocab_size, args.min_frequency, args.model_max_length)
    # two runs into one folder: the second is refused (without the lock both would check, train, and one be lost)
    lock = None if Path(args.output_dir).is_file() else OutputDirLock(args.output_dir).acquire()
    try:
        held = tokenizer_files(args.output_dir)
        if held and not args.overwrite:
            raise ValueError(f"--output_dir {args.output_dir} already holds a tokenizer ({', '.join(held)}): give "
                             "another --output_dir, or pass --overwrite to replace it")

        texts = iter_texts(args.inputs, text_column=args.text_column, split=args.split)
        print(f"training a byte-level BPE tokenizer of {args.vocab_size} tokens on {', '.join(args.inputs)}", flush=True)
        # no tokenizers progress bars: they write empty lines to stdout (three of them when it is not a terminal)
        tok = train_tokenizer(texts, args.vocab_size, args.min_frequency, args.model_max_length, args.output_dir)
    finally:
        if lock is not None:
            lock.release()
    print(f"saved a byte-level BPE tokenizer with {len(tok)} tokens to {args.output_dir}")
    return 0
