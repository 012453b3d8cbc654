"""``hf-lookaround demo``: pretrain small models with each objective and compare them (docs/pretraining.md)."""

from __future__ import annotations

import argparse
import logging

from ..demo import DEFAULT_OBJECTIVES, DEMO_OBJECTIVES, run
from .common import resolve_device


def _parser() -> argparse.ArgumentParser:
    # underscore flags as every other command takes them; the dashed spelling of earlier releases still works
    p = argparse.ArgumentParser(prog="hf-lookaround demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", nargs="+", default=list(DEFAULT_OBJECTIVES), choices=list(DEMO_OBJECTIVES))
    p.add_argument("--preset", default="tiny", help="model size (LookAroundConfig.from_preset); try small or base on a GPU")
    p.add_argument("--tokens_per_objective", "--tokens-per-objective", type=int, default=1_000_000, help="training tokens for each objective")
    p.add_argument("--block_size", "--block-size", type=int, default=128)
    p.add_argument("--batch_size", "--batch-size", type=int, default=16)
    p.add_argument("--learning_rate", "--learning-rate", type=float, default=3e-3)
    # 2,048 tokens: the LM head (hidden x vocab per target) is most of a tiny model's compute
    p.add_argument("--vocab_size", "--vocab-size", type=int, default=2048)
    p.add_argument("--perplexity_documents", "--perplexity-documents", type=int, default=20, help="test articles scored for perplexity")
    p.add_argument("--probe_max_length", "--probe-max-length", type=int, default=128, help="tokens of each article the probe sees")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--corpus_dir", "--corpus-dir", default=None, help="a folder of <label>/*.txt instead of the BBC news corpus")
    p.add_argument("--output_dir", "--output-dir", default="outputs/demo")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="one full run per seed (weights, plans, data order, untrained reference); the table claims "
                        "a probe gain only where it holds in every seed")
    p.add_argument("--no_baseline", "--no-baseline", action="store_true", help="skip the untrained reference row")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.WARNING)
    args.device = resolve_device(args.device)  # --device cuda without CUDA: one line, as the other commands say it
    run(args)
    return 0
