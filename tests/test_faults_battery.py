"""The fault hunt's battery (benchmarks/fault_hunt.py, issue 43): every hostile input ends the command with exit
status 2 and one line that names the problem (the file and line, the flag, the step), never a traceback; the cards
of a one-stream run and of a LoRA fine-tune say what their checkpoint is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import one_line_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fault_hunt  # noqa: E402

CASES = {case.name: case for case in fault_hunt.BATTERY}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return fault_hunt.battery_fixtures(tmp_path_factory.mktemp("battery"))


@pytest.mark.parametrize("name", list(CASES))
def test_each_hostile_input_ends_in_the_one_line_expected(ctx, capsys, name):
    case = CASES[name]
    if not case.runnable():
        pytest.skip(f"{case.needs} is not installed")
    if case.reads is not None:  # a command that must succeed and write what it should (a card)
        from hf_lookaround import cli

        assert cli.main(case.argv(ctx)) == 0, capsys.readouterr().err[-3000:]
        assert case.problems_in(ctx) == []
        return
    line = one_line_error(capsys, case.argv(ctx))  # rc 2, one error line (an exception would propagate here)
    assert line.startswith("hf-lookaround "), line
    for part in case.expect(ctx):
        assert part in line, f"{part!r} not in {line!r}"
    if name.startswith("a run that diverges"):  # and nothing calls its non-finite weights complete
        from hf_lookaround.training import checkpointing

        out = ctx["work"] / "run-nan"
        assert not (out / checkpointing.FINAL_MARKER).exists() and checkpointing.complete_checkpoints(out) == []


def test_demo_takes_underscore_flags_and_still_the_dashed_ones():
    from hf_lookaround.cli.demo import _parser

    new = _parser().parse_args(["--block_size", "7", "--output_dir", "x", "--no_baseline", "--tokens_per_objective", "5"])
    old = _parser().parse_args(["--block-size", "7", "--output-dir", "x", "--no-baseline", "--tokens-per-objective", "5"])
    assert vars(new) == vars(old) and new.block_size == 7 and new.no_baseline and new.tokens_per_objective == 5
