"""`hf-lookaround <command> ...`: one entry point; each command lives in its own module.

Start-up is kept short: this module and ``import hf_lookaround`` import neither torch nor transformers,
and a command's module is imported only when the command runs.

- ``hf-lookaround <command> --help`` prints the help page saved in ``cli_help.json`` when it was made
  with the installed versions of this package and transformers (so it answers without importing the
  command's torch/transformers code); otherwise the command's own parser prints it. A test checks
  that the saved pages equal what the parsers print; ``python -m hf_lookaround.cli --write-help``
  refreshes them.
- A ``ValueError`` (bad input) or ``OSError`` (a missing file or folder) ends the command with one line,
  ``hf-lookaround <command>: error: ...``, and exit status 2, as argparse does for bad options.
  ``--debug`` (anywhere on the command line) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

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
    "vision": ("hf_lookaround.vision", "main", "two-stream ViT on images (p2p/p2d/d2d): pretrain, probe, L2; sample"),
    "push": ("hf_lookaround.hub", "main", "push a checkpoint, its card and remote code to the Hub"),
}
HELP_FILE = Path(__file__).with_name("cli_help.json")
HELP_COLUMNS = "100"  # the saved pages are formatted at this width, whatever the terminal
USER_ERRORS = (ValueError, OSError)


def usage() -> str:
    lines = [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return ("usage: hf-lookaround <command> [options] [--debug]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`hf-lookaround <command> --help` for a command's options; --debug shows tracebacks of errors")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("hf_lookaround", "transformers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "none"
    return out


def saved_help(command: str) -> str | None:
    """The saved help page of ``command``, if it was made with the installed versions."""
    try:
        saved = json.loads(HELP_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if saved.get("versions") != _versions():
        return None
    return saved.get("commands", {}).get(command)


def parser_help(command: str) -> str:
    """What ``<command> --help`` prints through the command's own parser (imports the command's module)."""
    import contextlib
    import io

    module, function, _ = COMMANDS[command]
    out = io.StringIO()
    previous = os.environ.get("COLUMNS"), sys.argv[:]
    os.environ["COLUMNS"] = HELP_COLUMNS
    sys.argv[:1] = [f"hf-lookaround {command}"]  # argparse's default prog
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            getattr(importlib.import_module(module), function)(["--help"])
    finally:
        if previous[0] is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous[0]
        sys.argv[:] = previous[1]
    return out.getvalue()


def write_help() -> None:
    pages = {command: parser_help(command) for command in COMMANDS}
    HELP_FILE.write_text(json.dumps({"versions": _versions(), "commands": pages}, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(pages)} help pages to {HELP_FILE}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv == ["--write-help"]:
        write_help()
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{usage()}\n\nhf-lookaround: error: unknown command {command!r}", file=sys.stderr)
        return 2
    if rest and rest[0] in ("-h", "--help") and (page := saved_help(command)) is not None:
        print(page, end="")
        return 0
    module, function, _ = COMMANDS[command]
    sys.argv[:1] = [f"hf-lookaround {command}"]  # parsers built on sys.argv[0] (HfArgumentParser) name the command
    try:
        result = getattr(importlib.import_module(module), function)(rest)
    except USER_ERRORS as err:
        if debug:
            raise
        message = " ".join(str(err).split("\n")) if str(err) else type(err).__name__
        print(f"hf-lookaround {command}: error: {message}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
