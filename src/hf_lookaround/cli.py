"""`hf-lookaround <command> ...`: one entry point; each command lives in its own module."""

from __future__ import annotations

import importlib
import sys

# command -> (module, function, help). Modules are imported only when their command runs.
COMMANDS = {
    "demo": ("hf_lookaround.demo", "main", "pretrain small models with every objective and compare them"),
    "pretrain": ("hf_lookaround.pretraining", "main", "pretrain with Trainer on local files or a datasets name"),
    "train-tokenizer": ("hf_lookaround.tokenization", "main", "train a byte-level BPE tokenizer on local text"),
    "generate": ("hf_lookaround.generation", "main", "group decoding (ar/dar), any-order infilling (masked/GVP)"),
    "perplexity": ("hf_lookaround.evaluation.perplexity", "main", "AR and masked-model perplexity"),
    "probe": ("hf_lookaround.evaluation.probing", "main", "linear probe on frozen features"),
    "glue": ("hf_lookaround.evaluation.glue", "main", "GLUE-style fine-tuning, full or LoRA"),
    "theory": ("hf_lookaround.theory", "main", "co-occurrence matrices, spectra, Thm 3.1 / 4.2 checks"),
    "vision": ("hf_lookaround.vision", "main", "two-stream ViT on Fashion-MNIST: pretrain, probe, reconstruction L2"),
    "push": ("hf_lookaround.hub", "main", "push a checkpoint, its card and remote code to the Hub"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
        print("usage: hf-lookaround <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module, function, _ = COMMANDS[argv[0]]
    result = getattr(importlib.import_module(module), function)(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
