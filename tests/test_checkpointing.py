"""training/checkpointing.py, checkpoints you can trust (issue 23, items 1-4): a stale or damaged checkpoint is never
resumed silently, a finished run rerun with ``last`` changes nothing, an occupied ``output_dir`` and a second writer
are refused.

One tiny finished run (4 steps, checkpoints 2 and 4) is made once; each test damages a copy of it."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_lookaround import cli
from hf_lookaround.cli.pretrain import parse_args
from hf_lookaround.training import checkpointing
from hf_lookaround.training.pretraining import LookAroundTrainer, run


def snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


class Killed(BaseException):
    """A SIGKILL, in process: nothing after it runs."""


# ---------------------------------------------------------------------------------------------
# 1. a save never writes beside an old marker
# ---------------------------------------------------------------------------------------------
def test_a_save_killed_in_a_folder_with_an_old_marker_is_not_resumed(copy, make_args, monkeypatch):
    old_marker = (copy / "checkpoint-4" / checkpointing.COMPLETE_MARKER).read_bytes()

    def killed(self, output_dir):  # the weights of the new checkpoint-4 are written, nothing else
        raise Killed

    monkeypatch.setattr(LookAroundTrainer, "_save_optimizer_and_scheduler", killed)
    with pytest.raises(Killed):  # a resume from the older checkpoint-2, killed inside the save of checkpoint-4
        run(*parse_args(make_args(copy, "--resume_from_checkpoint", str(copy / "checkpoint-2"))))
    four = copy / "checkpoint-4"
    # the new weights never sit beside the old marker: checkpoint-4 is not complete, `last` is checkpoint-2
    assert not (four / checkpointing.COMPLETE_MARKER).is_file() or (
        (four / checkpointing.COMPLETE_MARKER).read_bytes() != old_marker)
    assert checkpointing.resolve_resume_checkpoint("last", copy) == str(copy / "checkpoint-2")


def test_the_checker_finds_new_files_under_a_stale_marker(copy):
    four = copy / "checkpoint-4"
    weights = four / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # other weights of the same size, as a rerun writes them
    weights.write_bytes(bytes(data))
    problems = checkpointing.checkpoint_problems(four)
    assert problems and "model.safetensors" in problems[0]


# ---------------------------------------------------------------------------------------------
# 2. missing or changed state is noticed
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["delete optimizer.pt", "delete rng_state.pth", "truncate optimizer.pt"])
def test_a_damaged_checkpoint_is_skipped_by_last_and_refused_by_name(copy, damage, caplog):
    action, name = damage.split()
    target = copy / "checkpoint-4" / name
    if action == "delete":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    with caplog.at_level("WARNING", logger="hf_lookaround.training.checkpointing"):
        assert checkpointing.resolve_resume_checkpoint("last", copy) == str(copy / "checkpoint-2")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "checkpoint-4" in warnings[0] and name in warnings[0]
    assert "\n" not in warnings[0]
    with pytest.raises(ValueError, match=f"checkpoint-4.*damaged.*{name}"):
        checkpointing.resolve_resume_checkpoint(str(copy / "checkpoint-4"), copy)


def test_a_run_resumed_past_a_damaged_checkpoint_sets_it_aside(copy, make_args):
    (copy / "checkpoint-4" / "optimizer.pt").unlink()
    run(*parse_args(make_args(copy, "--resume_from_checkpoint", "last", max_steps=6)))
    assert [p.name for p in checkpointing.list_checkpoints(copy)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for p in checkpointing.list_checkpoints(copy):
        assert checkpointing.checkpoint_problems(p) == [], p
    assert (copy / "damaged-checkpoint-4").is_dir()  # moved aside, not deleted
    state = json.loads((copy / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4, 5, 6]  # from step 2 on


# ---------------------------------------------------------------------------------------------
# 3. a finished run does not grow
# ---------------------------------------------------------------------------------------------
def test_rerunning_a_finished_run_with_last_changes_nothing(copy, make_args):
    before = snapshot(copy)
    assert cli.main(["pretrain", *make_args(copy, "--resume_from_checkpoint", "last")]) == 0
    assert [p.name for p in checkpointing.list_checkpoints(copy)] == ["checkpoint-2", "checkpoint-4"]
    after = snapshot(copy)
    assert after["model.safetensors"] == before["model.safetensors"]
    assert after == before


# ---------------------------------------------------------------------------------------------
# 4. output_dir is protected
# ---------------------------------------------------------------------------------------------
def test_an_occupied_output_dir_is_refused_without_resume_or_overwrite(copy, make_args, capsys):
    before = snapshot(copy)
    assert cli.main(["pretrain", *make_args(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite_output_dir" in err[0] and "--resume_from_checkpoint" in err[0], err
    assert snapshot(copy) == before
    # --overwrite_output_dir: a new run, whose checkpoints are not mixed with the old run's
    assert cli.main(["pretrain", *make_args(copy, "--overwrite_output_dir", max_steps=2)]) == 0
    assert [p.name for p in checkpointing.list_checkpoints(copy)] == ["checkpoint-2"]
    assert json.loads((copy / "trainer_state.json").read_text())["global_step"] == 2


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_taken_over(make_args, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / checkpointing.LOCK_FILE
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock.write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname()}))
        assert cli.main(["pretrain", *make_args(out, max_steps=1)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(sleeper.pid) in err[0] and "in use" in err[0], err
        assert not (out / "model.safetensors").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    # the writer died (SIGKILL): its lock is stale on this host and is taken over with a warning
    with caplog.at_level("WARNING", logger="hf_lookaround.training.checkpointing"):
        assert cli.main(["pretrain", *make_args(out, max_steps=1)]) == 0
    assert any("stale" in r.getMessage() and str(sleeper.pid) in r.getMessage() for r in caplog.records)
    assert (out / "model.safetensors").is_file() and not lock.exists()  # released at exit


@pytest.mark.parametrize("marker", ["checkpoint", "final model"])
def test_a_byte_changed_outside_the_sampled_windows_is_found(tmp_path, marker):
    """Issue 43: the sample digest reads 64 KiB at the start, middle and end; the marker's sha256 of the whole file
    finds a same-size corruption anywhere else (here 1 MiB of weights, one byte changed at 160 KiB)."""
    import torch
    from safetensors.torch import save_file

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(1 << 18)}, str(weights))  # 1 MiB
    (tmp_path / "config.json").write_text("{}")
    if marker == "checkpoint":
        checkpointing._write_marker(tmp_path, [weights, tmp_path / "config.json"], checkpointing.COMPLETE_MARKER)
        problems = lambda: checkpointing.checkpoint_problems(tmp_path)  # noqa: E731
    else:
        checkpointing.mark_final_model(tmp_path, 4)
        problems = lambda: checkpointing.final_model_problems(tmp_path)  # noqa: E731
    assert problems() == []
    data = bytearray(weights.read_bytes())
    offset = 160 << 10
    size, window = len(data), 1 << 16
    assert window < offset < size // 2 - window // 2  # outside every sampled window
    data[offset] ^= 0x40
    weights.write_bytes(bytes(data))
    assert problems() == ["model.safetensors changed after the marker was written (its sha256 differs)"]
