"""`hf-lookaround lm-eval ...`: lm-evaluation-harness with the package's model class ``lookaround`` registered.

lm-eval 0.4 discovers no model plugins, so this command imports :mod:`hf_lookaround.evaluation.lm_eval_model`
(which registers ``lookaround``) and hands its whole command line to lm-eval's own entry point
(``lm_eval.__main__.cli_evaluate``), with ``--model lookaround`` unless another ``--model`` is given. A local
checkpoint named by ``pretrained=`` is checked first (``lm_eval_model.check_checkpoint``: the package loader's
checks, NaN weights included), so a damaged or vision checkpoint ends the command in one line before lm-eval
prints anything:

    hf-lookaround lm-eval --model_args pretrained=CKPT,mc_num=128,seed=0 --tasks lambada_openai --batch_size 8
"""

from __future__ import annotations

import sys

LM_EVAL_COMMANDS = ("run", "ls", "validate")


def harness_argv(argv: list[str]) -> list[str]:
    """lm-eval's arguments: ``argv`` with ``--model lookaround`` added to a run that names no model."""
    argv = list(argv)
    names_model = any(a == "--model" or a.startswith("--model=") for a in argv)
    if names_model or (argv and argv[0] in ("ls", "validate")) or argv in ([], ["-h"], ["--help"]):
        return argv
    at = 1 if argv[:1] == ["run"] else 0
    return argv[:at] + ["--model", "lookaround"] + argv[at:]


def pretrained_argument(argv: list[str]) -> str | None:
    """The ``pretrained=`` value of ``--model_args`` (``-a``) in lm-eval's spellings: ``k=v,k2=v2``, ``k=v k2=v2``,
    ``--model_args=k=v``."""
    values, taking = [], False
    for arg in argv:
        if arg in ("--model_args", "-a"):
            taking = True
        elif arg.startswith("--model_args="):
            values.append(arg.split("=", 1)[1])
            taking = False
        elif arg.startswith("-"):
            taking = False
        elif taking:
            values.append(arg)
    pairs = [item.split("=", 1) for value in values for item in value.split(",") if "=" in item]
    found = [v for k, v in pairs if k.strip() == "pretrained"]
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        if argv in (["-h"], ["--help"]):  # the help needs no harness; say how to get it
            print(__doc__.strip() + "\n\nlm-eval is not installed: pip install 'hf-lookaround[lm-eval]'")
            raise SystemExit(0) from None
        raise ValueError(f"lm-eval is not installed ({err}): pip install 'hf-lookaround[lm-eval]'") from err
    import hf_lookaround.evaluation.lm_eval_model  # noqa: F401  (registers the model class `lookaround`)

    if argv in (["-h"], ["--help"]):
        from lm_eval._cli import HarnessCLI

        print("usage: hf-lookaround lm-eval [run] --model_args pretrained=CKPT[,mc_num=N,seed=S,...] --tasks TASKS "
              "[lm-eval run options]\n\n" + __doc__.strip() + "\n\nlm-eval's own options (`lm-eval run`):\n")
        HarnessCLI()._subparsers.choices["run"].print_help()
        raise SystemExit(0)
    pretrained = pretrained_argument(argv)
    if pretrained:
        # NaN weights too: lm-eval would print its set-up and then a traceback around from_pretrained's refusal
        hf_lookaround.evaluation.lm_eval_model.check_checkpoint(pretrained, "hf-lookaround lm-eval", finite=True)
    saved = sys.argv
    sys.argv = ["hf-lookaround lm-eval", *harness_argv(argv)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
