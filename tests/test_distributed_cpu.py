"""`torchrun --standalone --nproc_per_node 2 -m hf_lookaround.cli pretrain ...` on a machine without a GPU, as
docs/distributed.md shows it (no --use_cpu): one world of 2 processes (gloo), not two worlds of 1 racing for the
output folder (issue 23, item 6)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil  # accelerate's own dependency

from hf_lookaround.training import checkpointing
from conftest import HUNG_CHILD_SECONDS, PLAN_WORDS  # a guard against a hung child, not a speed test


def test_torchrun_on_a_cpu_machine_makes_one_world_of_two(tmp_path, tokenizer_dir):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(PLAN_WORDS) for _ in range(60)) for _ in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "hf_lookaround.cli", "pretrain", "--train_files", str(tmp_path / "train.jsonl"),
           "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny",
           "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64",
           "--block_size", "16", "--do_train", "--max_steps", "2", "--save_steps", "2",
           "--per_device_train_batch_size", "2", "--validation_split_percentage", "0", "--report_to", "none",
           "--disable_tqdm", "true", "--output_dir", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    marker = json.loads((out / "checkpoint-2" / checkpointing.COMPLETE_MARKER).read_text())
    assert marker["world_size"] == 2, marker
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["train_batch_size"] == 2
    assert "gloo" in proc.stderr and "--use_cpu true" in proc.stderr  # it says what it chose
    # the data summary is logged by the main process only (issue 23, item 15)
    assert proc.stderr.count("training blocks of 16 tokens") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("training data: ") == 1, proc.stderr[-3000:]


def _two_machines(tmp_path, tokenizer_dir, out, max_steps, port, resume=False):
    """Two `accelerate launch` "machines" of PROCESSES_PER_MACHINE processes each on this host, as
    docs/distributed.md's recipe runs them on two nodes: same config and arguments, --machine_rank 0 and 1, rendezvous
    on the main machine's address (here 127.0.0.1). Each launcher gets a session of its own (to be killed whole)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    config = Path(__file__).resolve().parent.parent / "examples" / "accelerate" / "ddp.yaml"
    procs = []
    for machine_rank in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_machines", "2", "--num_processes", str(2 * PROCESSES_PER_MACHINE),
               "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               "-m", "hf_lookaround.cli", "pretrain", "--train_files", str(tmp_path / "train.jsonl"),
               "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny",
               "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64",
               "--objective", "dar", "--group_size", "2", "--dar_form", "single_stream",
               "--block_size", "16", "--do_train", "--max_steps", str(max_steps), "--save_steps", "2",
               "--per_device_train_batch_size", "2", "--validation_split_percentage", "0", "--report_to", "none",
               "--disable_tqdm", "true", "--output_dir", str(out)]
        if resume:
            cmd += ["--resume_from_checkpoint", "last"]
        log = open(tmp_path / f"machine{machine_rank}{'_resume' if resume else ''}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                      log))
    return procs


PROCESSES_PER_MACHINE = 1  # 2 machines x 1 process: a world of 2 over two launchers (2 cores on CI)


def test_two_machine_launch_trains_is_killed_and_resumes_from_last(tmp_path, tokenizer_dir):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(PLAN_WORDS) for _ in range(60)) for _ in range(60)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "run"
    world = 2 * PROCESSES_PER_MACHINE
    port = 29500 + os.getpid() % 1000
    # first run: killed (SIGKILL, both machines) once a checkpoint is complete and before it ends
    procs = _two_machines(tmp_path, tokenizer_dir, out, max_steps=400, port=port)
    deadline = time.monotonic() + HUNG_CHILD_SECONDS
    try:
        while not (out / "checkpoint-2" / checkpointing.COMPLETE_MARKER).exists():
            assert all(p.poll() is None for p, _ in procs), (tmp_path / "machine0.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        # a machine lost whole: its launcher and every rank (torch's elastic agent starts the ranks in sessions of
        # their own, so the launcher's process group does not hold them)
        for p, log in procs:
            tree = [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)] if p.poll() is None else []
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            log.close()
    assert not (out / "trainer_state.json").exists()  # killed before the end
    killed_at = max(int(c.name.split("-")[1]) for c in out.glob("checkpoint-*")
                    if (c / checkpointing.COMPLETE_MARKER).exists())
    # resumed from `last` on both machines, with a new port (the old one may linger in TIME_WAIT)
    stop = killed_at + 4
    procs = _two_machines(tmp_path, tokenizer_dir, out, max_steps=stop, port=port + 1, resume=True)
    for p, log in procs:
        p.wait(timeout=HUNG_CHILD_SECONDS)
        log.close()
    logs = [(tmp_path / f"machine{r}_resume.log").read_text() for r in (0, 1)]
    assert all(p.returncode == 0 for p, _ in procs), logs[0][-3000:] + logs[1][-3000:]
    assert f"resuming from {out / f'checkpoint-{killed_at}'}" in logs[0], logs[0][-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == stop
    marker = json.loads((out / f"checkpoint-{stop}" / checkpointing.COMPLETE_MARKER).read_text())
    assert marker["world_size"] == world, marker
