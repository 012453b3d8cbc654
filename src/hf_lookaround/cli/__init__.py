"""`hf-lookaround <command> ...`: one entry point; each command is one module of this folder.

``hf-lookaround --help`` answers at once: this module imports neither torch nor transformers, and a command's
module is imported only when the command runs (its ``--help`` included, so that one takes as long as importing
torch and transformers).

A ``ValueError`` (bad input) or ``OSError`` (a missing file or folder) ends the command with one line,
``hf-lookaround <command>: error: ...``, and exit status 2, as argparse does for bad options. ``--traceback``
(or ``--debug``, anywhere on the command line) shows the traceback instead. The Trainer commands keep
``--debug VALUE`` for ``TrainingArguments.debug`` (``--debug underflow_overflow``).
"""

from __future__ import annotations

import importlib
import sys

# command -> (module of this folder, help)
COMMANDS = {
    "demo": ("demo", "pretrain small models with every objective and compare them"),
    "pretrain": ("pretrain", "pretrain with Trainer on local files or a datasets name"),
    "train-tokenizer": ("train_tokenizer", "train a byte-level BPE tokenizer on local text"),
    "generate": ("generate", "group decoding (ar/dar), any-order infilling (masked/GVP)"),
    "perplexity": ("perplexity", "AR and masked-model perplexity"),
    "lm-eval": ("lm_evaluation", "lm-evaluation-harness with the model class `lookaround` (every text checkpoint)"),
    "probe": ("probe", "linear probe on frozen features"),
    "glue": ("glue", "GLUE-style fine-tuning, full or LoRA"),
    "theory": ("theory", "co-occurrence matrices, spectra, Thm 3.1 / 4.2 checks"),
    "vision": ("vision", "two-stream ViT on images (p2p/p2d/d2d): pretrain, probe, L2; sample"),
    "push": ("push", "push a checkpoint, its card and remote code to the Hub"),
    "convert": ("convert", "convert a Llama/Mistral/Qwen2/Qwen3/GPT-2 folder into a LookAround checkpoint"),
    "export": ("export", "write a single-stream causal checkpoint back in its family's format"),
}
USER_ERRORS = (ValueError, OSError)
# commands whose own options include TrainingArguments' `--debug VALUE`
TRAINER_COMMANDS = ("pretrain", "glue")


def _own_debug_flag(argv: list[str]) -> tuple[bool, list[str]]:
    """Take the CLI's traceback flag out of ``argv``: ``--traceback``, or a ``--debug`` that carries no value
    of a Trainer command (``pretrain ... --debug underflow_overflow`` is TrainingArguments' and stays)."""
    trainer = bool(argv) and argv[0] in TRAINER_COMMANDS
    found, rest = False, []
    for i, arg in enumerate(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("-")
        if arg == "--traceback" or (arg == "--debug" and not (trainer and has_value)):
            found = True
            continue
        rest.append(arg)
    return found, rest


def usage() -> str:
    lines = [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    return ("usage: hf-lookaround <command> [options] [--traceback]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`hf-lookaround <command> --help` for a command's options; --traceback (or --debug) shows "
            "tracebacks of errors")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, argv = _own_debug_flag(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{usage()}\n\nhf-lookaround: error: unknown command {command!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{COMMANDS[command][0]}")
    sys.argv[:1] = [f"hf-lookaround {command}"]  # parsers built on sys.argv[0] (HfArgumentParser) name the command
    try:
        result = module.main(rest)
    except USER_ERRORS as err:
        if debug:
            raise
        message = " ".join(str(err).split("\n")) if str(err) else type(err).__name__
        print(f"hf-lookaround {command}: error: {message}", file=sys.stderr)
        return 2
    return int(result or 0)
