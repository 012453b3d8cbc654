"""The command line: a lazy package, fast help pages, one-line errors, Auto classes after a lazy import."""

import subprocess
import sys

import pytest

from hf_lookaround import cli
from conftest import HUNG_CHILD_SECONDS  # a guard against a hung child, not a speed test

ENV_CODE = "import os; os.environ.setdefault('HF_HUB_OFFLINE', '1')\n"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENV_CODE + code], capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS)


def test_import_and_help_load_neither_torch_nor_transformers():
    code = (
        "import sys, io, contextlib\n"
        "import hf_lookaround\n"
        "from hf_lookaround.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert main(['--help']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(len(out.getvalue()), heavy)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    size, heavy = result.stdout.split(" ", 1)
    assert int(size) > 500 and heavy.strip() == "[]", result.stdout


def test_every_command_prints_its_help(capsys):
    """A command's --help comes from its own parser (it imports the command's module)."""
    for command in cli.COMMANDS:
        with pytest.raises(SystemExit) as done:
            cli.main([command, "--help"])
        assert done.value.code == 0, command
        page = capsys.readouterr().out
        assert page.startswith(f"usage: hf-lookaround {command} "), page[:80]


def test_names_are_imported_on_first_use_and_auto_classes_still_work(tmp_path):
    import hf_lookaround

    model = hf_lookaround.LookAroundForPreTraining(hf_lookaround.LookAroundConfig.from_preset("tiny", vocab_size=64))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "modeling_lookaround.py").exists(), "registration must still write the remote code"
    for imports in ("import hf_lookaround\nfrom transformers import AutoModel, AutoConfig",
                    "from transformers import AutoModel, AutoConfig\nimport hf_lookaround",
                    "import hf_lookaround.training.pretraining\nfrom transformers import AutoModel, AutoConfig"):
        code = (
            f"import sys\n{imports}\n"
            f"config = AutoConfig.from_pretrained({str(tmp_path)!r})\n"
            f"model = AutoModel.from_pretrained({str(tmp_path)!r})\n"
            "print(type(config).__name__, type(model).__name__)\n"
        )
        result = _python(code)
        assert result.returncode == 0, (imports, result.stderr[-2000:])
        assert result.stdout.split() == ["LookAroundConfig", "LookAroundModel"], imports
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        hf_lookaround.NotAName  # noqa: B018


def test_user_errors_are_one_line_with_exit_status_2(capsys, tmp_path):
    # a command left with nothing to do says so
    assert cli.main(["pretrain", "--train_files", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                     "--do_eval", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-lookaround pretrain: error: nothing to do") and "\n" not in err
    assert "Traceback" not in err
    # an invalid mask-ratio range
    assert cli.main(["pretrain", "--train_files", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                     "--objective", "vmlm", "--mask_ratio_range", "0.4", "0.2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-lookaround pretrain: error:") and "mask_ratio_range" in err and "\n" not in err
    # --debug shows the traceback: the exception propagates
    with pytest.raises(ValueError, match="nothing to do"):
        cli.main(["pretrain", "--train_files", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                  "--do_eval", "false", "--debug"])


def test_unknown_command_is_exit_2(capsys):
    assert cli.main(["pretrian"]) == 2
    assert "unknown command 'pretrian'" in capsys.readouterr().err
    assert cli.main([]) == 0 and "commands:" in capsys.readouterr().out


def test_console_script_answers_a_user_error_without_traceback(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = subprocess.run([sys.executable, "-m", "hf_lookaround.cli", "train-tokenizer", str(empty),
                             "--output_dir", str(tmp_path / "tok")], capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("hf-lookaround train-tokenizer: error:")
    assert "Traceback" not in result.stderr


def test_a_skip_for_missing_data_fails_the_run(tmp_path):
    """tests/conftest.py turns a skip whose reason says data is missing into a failure; other skips stay."""
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_policy.py").write_text(
        "import pytest\n"
        "@pytest.mark.skipif(True, reason='shared data not found')\n"
        "def test_needs_data():\n    pass\n"
        "def test_skips_for_another_reason():\n    pytest.skip('covered by a smaller case')\n"
    )
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS, cwd=tmp_path)
    # a skipif mark skips during setup, so the report is an error there: either way the run fails
    assert result.returncode == 1 and "1 skipped" in result.stdout, result.stdout[-2000:]
    assert "skipped for missing data (Skipped: shared data not found)" in result.stdout


# TrainingArguments' `--debug VALUE` reaches the Trainer commands; the CLI's own --traceback/--debug still work
def test_trainer_commands_keep_debug_with_a_value(monkeypatch, tmp_path):
    from hf_lookaround.cli import pretrain

    seen = {}
    monkeypatch.setattr(pretrain, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["pretrain", "--output_dir", str(tmp_path), "--debug", "underflow_overflow"]) == 0
    assert seen["argv"][-2:] == ["--debug", "underflow_overflow"]
    from hf_lookaround.cli.pretrain import parse_args

    *_, training_args = parse_args(["--output_dir", str(tmp_path), "--debug", "underflow_overflow"])
    assert [d.value for d in training_args.debug] == ["underflow_overflow"]


def test_the_cli_traceback_flag_still_works(tmp_path):
    for flag in ("--traceback", "--debug"):
        with pytest.raises(ValueError, match="nothing to do"):
            cli.main(["pretrain", "--train_files", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                      "--do_eval", "false", flag])
