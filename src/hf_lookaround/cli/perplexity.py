"""``hf-lookaround perplexity``: AR and masked-model perplexity of a checkpoint (docs/evaluation.md)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from ..evaluation import perplexity
from ..data.subsets import seeded_sample
from ..hub.load import load_checkpoint
from ..hub.weights import check_local_checkpoint
from ..decoding import is_one_stream_group_model
from .common import resolve_device
from ..evaluation.perplexity import (
    MASKED_MODES,
    PROTOCOLS,
    ar_perplexity,
    elbo_perplexity,
    format_elbo_table,
    format_table,
    masked_perplexity,
    plot_by_prefix_length,
)

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-lookaround perplexity", description=perplexity.__doc__.split("\n\n")[0])
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--tokenizer_name", default=None, help="defaults to the model path")
    p.add_argument("--dataset", required=True, help="a text file, a directory with <split>.jsonl(.gz), or a datasets name")
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--split", default="test")
    p.add_argument("--text_column", default="text")
    p.add_argument("--protocol", choices=PROTOCOLS, default="ar")
    p.add_argument(
        "--masked_mode",
        choices=("auto",) + MASKED_MODES,
        default="auto",
        help="auto: mask_token for single-stream masked LMs; for two-stream LookAround checkpoints two_stream "
        "(AR plan) if pretrained with ar/dar, else two_stream_prefix",
    )
    p.add_argument("--max_length", type=int, default=None,
                   help="window length (default: the trained block size, config.trained_block_size; else min(512, "
                        "max positions))")
    p.add_argument("--stride", type=int, default=None, help="default: max_length // 2")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_documents", type=int, default=None,
                   help="score only N documents (a random sample, seeded by --seed, in file order)")
    p.add_argument("--seed", type=int, default=42, help="draws the --max_documents sample and the elbo protocol's Monte-Carlo draws")
    p.add_argument("--no_bos", action="store_true", help="do not prepend BOS/CLS (the first token is then unscored)")
    p.add_argument("--positions_per_window", type=int, default=None,
                   help="masked protocol, per-prefix modes: score only this many evenly spaced prefix lengths of each "
                        "window (one forward row each; default: every position)")
    p.add_argument("--num_samples", type=int, default=16,
                   help="elbo protocol: Monte-Carlo draws of times and masks per window (seeded by --seed)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return p


def _load_model(args):
    import transformers

    import hf_lookaround  # noqa: F401  (registers the LookAround Auto classes)

    # a LookAround text checkpoint or a model of another type (a vision checkpoint is refused before its config)
    check_local_checkpoint(args.model_name_or_path, "hf-lookaround perplexity", kinds=("text", "other"))
    config = transformers.AutoConfig.from_pretrained(args.model_name_or_path)
    # a LookAround checkpoint pretrained with a plan (two streams) is evaluated through its query stream
    two_stream = "LookAroundForPreTraining" in (config.architectures or [])
    if args.protocol == "ar":
        cls = transformers.AutoModelForPreTraining if two_stream else transformers.AutoModelForCausalLM
    else:
        if args.masked_mode.startswith("two_stream") and config.model_type != "lookaround":
            raise ValueError(f"masked_mode={args.masked_mode} needs a LookAround checkpoint, got {config.model_type!r}")
        if args.masked_mode != "auto":
            two_stream = args.masked_mode.startswith("two_stream")
        cls = transformers.AutoModelForPreTraining if two_stream else transformers.AutoModelForMaskedLM
    return load_checkpoint(cls, args.model_name_or_path, "hf-lookaround perplexity", kinds=("text", "other"))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag in ("max_length", "stride", "batch_size", "max_documents"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            unit = {"batch_size": "windows per forward", "max_documents": "documents"}.get(flag, "tokens")
            raise ValueError(f"--{flag} {value}: must be a positive number of {unit} (leave it out for the default)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from hf_lookaround.data.tokenization import auto_tokenizer
    from hf_lookaround.evaluation.tasks import load_texts

    device = resolve_device(args.device)
    model = _load_model(args)
    model.to(device).eval()
    tokenizer = auto_tokenizer(args.tokenizer_name or args.model_name_or_path)

    texts = load_texts(args.dataset, args.split, args.text_column, args.dataset_config_name)
    texts = seeded_sample(texts, args.max_documents, args.seed, what="documents", flag="--max_documents",
                          keep_order=True)
    max_positions = getattr(model.config, "max_position_embeddings", None) or 512
    # dar's one-stream form lays each window out after its start rows: its config's n_positions leaves room for them
    one_stream = is_one_stream_group_model(model.config)
    limit = perplexity.window_limit(model.config)
    # default: the window the checkpoint was trained on (config.trained_block_size), else up to 512 tokens
    max_length = args.max_length if args.max_length is not None else perplexity.default_max_length(model.config)
    if max_length > limit:
        extra = f" less the {max_positions - limit} start rows of dar's one-stream layout" if one_stream else ""
        raise ValueError(f"--max_length {max_length} exceeds the model's max_position_embeddings ({max_positions})"
                         f"{extra}: use --max_length {limit} or less")
    stride = args.stride if args.stride is not None else max(1, max_length // 2)
    add_bos = False if args.no_bos else None

    if args.protocol == "ar":
        result = ar_perplexity(model, tokenizer, texts, max_length, stride, args.batch_size, add_bos)
    elif args.protocol == "elbo":
        result = elbo_perplexity(model, tokenizer, texts, max_length, stride, args.batch_size, add_bos,
                                 num_samples=args.num_samples, seed=args.seed)
    else:
        result = masked_perplexity(model, tokenizer, texts, max_length, stride, args.batch_size, add_bos, args.masked_mode,
                                   positions_per_window=args.positions_per_window)
    mode = result.extra.get("masked_mode") or result.extra.get("ar_mode")
    result.extra.update({"model": args.model_name_or_path, "split": args.split, "num_documents": len(texts)})

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = result.to_dict(dataset=args.dataset)
    (out / "perplexity.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.protocol == "elbo":  # a bound per window: no prefix-length table
        table = format_elbo_table(report)
        (out / "perplexity_elbo.md").write_text(table + "\n")
        print(f"elbo_perplexity = {report['elbo_perplexity']:.3f} (a bound; standard error of the NLL "
              f"{report['standard_error']:.4f} nats, {report['num_samples']} samples)  bits_per_byte = "
              f"{report['bits_per_byte']:.4f}  tokens = {report['num_tokens']}")
        print(table)
        print(f"wrote {out / 'perplexity.json'}")
        return 0
    table = format_table(report["by_prefix_length"])
    (out / "perplexity_by_prefix.md").write_text(table + "\n")
    title = f"{args.protocol}" + (f" ({mode})" if mode else "") + f", {Path(args.model_name_or_path).name}"
    plot_by_prefix_length(report["by_prefix_length"], out / "perplexity_by_prefix.png", title)
    key = "ar_perplexity" if args.protocol == "ar" else "masked_perplexity"
    print(f"{key} = {report[key]:.3f}  bits_per_byte = {report['bits_per_byte']:.4f}  tokens = {report['num_tokens']}")
    print(table)
    print(f"wrote {out / 'perplexity.json'}")
    return 0
