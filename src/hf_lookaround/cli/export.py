"""``hf-lookaround export CKPT -o OUT``: a LookAround checkpoint whose causal view is exactly a Llama, Mistral, Qwen2,
Qwen3 or GPT-2 forward, written in that family's format (plain transformers, vLLM, llama.cpp read it)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround export",
        description="Write a single-stream causal LookAround checkpoint (a conversion, or one pretrained with "
        "--objective ar --ar_form single_stream) in its family's format, which transformers loads without this "
        "package and with the same logits. Other checkpoints are refused with the reason.",
    )
    parser.add_argument("checkpoint", help="a LookAround checkpoint folder")
    parser.add_argument("-o", "--output_dir", required=True, help="a new folder for the exported model")
    args = parser.parse_args(argv)

    from ..adaptation import export

    family = export(args.checkpoint, args.output_dir)
    print(f"exported {args.checkpoint} -> {args.output_dir} as model_type {family!r}: "
          f"AutoModelForCausalLM.from_pretrained({args.output_dir!r}) loads it without this package")
    return 0
