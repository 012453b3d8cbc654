"""``hf-lookaround convert SRC -o DST``: a Llama, Mistral, Qwen2, Qwen3 or GPT-2 folder -> a LookAround checkpoint."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround convert",
        description="Convert a local causal LM folder (config.json, safetensors weights, tokenizer; model_type llama, "
        "mistral, qwen2, qwen3 or gpt2) into a LookAround checkpoint whose causal view gives the source's logits. "
        "A mask token is added where the tokenizer has none (docs/adaptation.md).",
    )
    parser.add_argument("src", help="the causal LM folder")
    parser.add_argument("-o", "--output_dir", required=True, help="a new folder for the LookAround checkpoint")
    parser.add_argument("--max_length", type=int, default=None,
                        help="keep this many positions (default: the source's); a sliding-window source converts "
                             "exactly up to its window")
    args = parser.parse_args(argv)

    from ..adaptation import convert_folder

    out = convert_folder(args.src, args.output_dir, args.max_length)
    # without the package the tokenizer needs the flag too: AutoTokenizer reads config.json, which is remote code
    print(f"converted {args.src} -> {out}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r}) and "
          f"AutoTokenizer.from_pretrained({str(out)!r}) after import hf_lookaround (without the package: both with "
          "trust_remote_code=True), or adapt it with hf-lookaround pretrain --init_from")
    return 0
