"""The device scripts of issues 39 and 40 (benchmarks/adapt_device_call.sh, benchmarks/diffusion_device_call.sh) must
not spend a GPU call on a flag that today's code no longer takes. Each script runs here with stand-ins for
``python3``, ``torchrun`` and ``nvidia-smi`` on PATH that record their arguments (and leave the files the next stage
looks for); every recorded command is then parsed by the real parser it is meant for. The scripts' CPU smoke runs
(``python benchmarks/adapt_bench.py --smoke --out DIR``, ``python benchmarks/diffusion_bench.py --smoke --out DIR``)
run them for real; they take minutes, so they are not tests."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HUNG_CHILD_SECONDS  # a guard against a hung child, not a speed test

from hf_lookaround.cli.pretrain import parse_args as pretrain_parse_args
from hf_lookaround.cli.perplexity import _parser as perplexity_parser

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


adapt_bench, diffusion_bench = _load("adapt_bench"), _load("diffusion_bench")

def parse_pretrain(argv):
    """hf-lookaround pretrain's parser on ``argv``; ``--bf16 true`` read as false (no bf16 device here: the flag's
    name and value type are what is checked)."""
    argv = list(argv)
    for i, a in enumerate(argv[:-1]):
        if a == "--bf16" and argv[i + 1] == "true":
            argv[i + 1] = "false"
    return pretrain_parse_args(argv)


# The stand-in: records argv (torchrun's own options dropped) and makes what the script checks for next.
STAND_IN = r'''
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
if Path(sys.argv[0]).name == "torchrun":
    while argv[0].startswith("--"):
        argv = argv[2:] if argv[0] in ("--nproc_per_node",) else argv[1:]
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps(argv) + "\n")
def value(flag):
    return argv[argv.index(flag) + 1]
if argv[:2] == ["-m", "hf_lookaround.cli"]:
    command = argv[2]
    if command == "train-tokenizer":
        Path(value("-o")).mkdir(parents=True, exist_ok=True); Path(value("-o"), "tokenizer.json").write_text("{}")
    elif command == "convert":
        Path(value("-o")).mkdir(parents=True, exist_ok=True); Path(value("-o"), "config.json").write_text("{}")
    elif command == "pretrain":
        out, steps, every = Path(value("--output_dir")), int(value("--max_steps")), int(value("--save_steps"))
        for step in range(every, steps + 1, every):
            (out / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True); (out / "final_model_complete.json").write_text("{}")
elif argv[1:2] == ["source"]:
    Path(value("--out")).mkdir(parents=True, exist_ok=True); Path(value("--out"), "source_run.json").write_text("{}")
elif argv[1:2] == ["eval"]:
    Path(value("--out")).write_text("{}"); Path(value("--out")).with_suffix(".md").write_text("")
'''


def _run_script(tmp_path, script, env, *args):
    """Run a device script with the stand-ins; its recorded commands, the wheels' pip install left out."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "torchrun"):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{STAND_IN}")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf 'GPU 0: stand-in\\nGPU 1: stand-in\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    full_env = {k: v for k, v in os.environ.items() if k != "DEVICE_SMOKE"}
    full_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(calls), OUT=str(tmp_path / "out"), **env)
    done = subprocess.run(["bash", str(BENCH / script), *args], env=full_env, capture_output=True, text=True,
                          timeout=HUNG_CHILD_SECONDS)
    assert done.returncode == 0, done.stdout + done.stderr
    return [c for c in map(json.loads, calls.read_text().splitlines()) if c[:2] != ["-m", "pip"]]


DEVICE_SCRIPTS = sorted([*BENCH.glob("*.sh"), *(BENCH.parent / "study").glob("*.sh")])


@pytest.mark.parametrize("script", DEVICE_SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_device_scripts_are_valid_bash(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("smoke", [False, True], ids=["device", "smoke"])
def test_every_command_of_the_adaptation_call_parses(tmp_path, smoke):
    env = dict(R=str(tmp_path / "runs"), TRAIN="train.jsonl.gz", VALID="valid.jsonl.gz", TOK=str(tmp_path / "tok"))
    if smoke:  # adapt_bench.py --smoke's sizes and switch
        env.update(adapt_bench.SMOKE_RUN, DEVICE_SMOKE="1")
    calls = _run_script(tmp_path, "adapt_device_call.sh", env)
    pretrains = [c[3:] for c in calls if c[:3] == ["-m", "hf_lookaround.cli", "pretrain"]]
    for argv in pretrains:
        *_, training_args = parse_pretrain(argv)
        assert training_args.output_dir == argv[argv.index("--output_dir") + 1]
    benches = [c[1:] for c in calls if c[0].endswith("adapt_bench.py")]
    assert [b[0] for b in benches] == ["source", "eval"]
    for argv in benches:
        assert adapt_bench.parse_args(argv).smoke is smoke
    # every stage ran, 3b's annealed arm included: 2 objectives x (budgets + annealed + scratch)
    budgets = len((env.get("ADAPT_TOKENS") or "10000000 20000000 40000000").split())
    assert len(pretrains) == 2 * (budgets + 2)
    annealed = [a for a in pretrains if "--attention_annealing_steps" in a]
    assert [Path(a[a.index("--output_dir") + 1]).name for a in annealed] == [
        f"{o}_adapt_{'2k' if smoke else '20M'}_annealed" for o in ("dar", "mixture")]
    for argv in annealed:  # the first 1/ANNEAL_SHARE of the run's steps
        share = int(env.get("ANNEAL_SHARE", 4))
        assert int(argv[argv.index("--attention_annealing_steps") + 1]) == int(argv[argv.index("--max_steps") + 1]) \
            // share > 0
    names = [item.split("=", 1)[0] for item in benches[1] if "=" in item]
    assert {"dar_adapt_2k_annealed", "mixture_adapt_2k_annealed"} <= set(names) if smoke else \
        {"dar_adapt_20M_annealed", "mixture_scratch_240M"} <= set(names)
    assert ("--bf16", "false" if smoke else "true") in zip(pretrains[0], pretrains[0][1:])


def test_the_diffusion_call_and_every_cell_command_parse(tmp_path, monkeypatch):
    (calls,) = _run_script(tmp_path, "diffusion_device_call.sh", {}, "--seeds", "0", "1")
    assert calls[0].endswith("diffusion_bench.py")
    args = diffusion_bench.parse_args(calls[1:])
    assert args.seeds == [0, 1] and args.work_dir == "runs/diffbench" and args.records_from == [".devdata/diffbench"]
    # each cell's job: the pretrain and perplexity commands it runs (the job's own subprocess stood in for)
    commands = []

    def fake_run(cmd, log_path):
        commands.append(cmd)
        if cmd[3] == "perplexity":
            folder = Path(cmd[cmd.index("--output_dir") + 1])
            folder.mkdir(parents=True)
            (folder / "perplexity.json").write_text('{"perplexity": 1.0}')
        return 0

    monkeypatch.setattr(diffusion_bench, "_run", fake_run)
    settings = dict(corpus_dir="c", preset="tiny", block_size=64, batch_size=4, steps=4, save_every=2, cuda=True,
                    num_proc=2, eval_batch_size=8, elbo_samples=2)
    for cell in diffusion_bench.CELLS:
        folder = tmp_path / "cells" / cell
        spec = dict(cell=cell, seed=0, folder=str(folder), settings=settings, gpu="0",
                    prep={"tokenizer": "tok", "heldout": "heldout.jsonl.gz"})
        assert diffusion_bench.cell_job(spec) == 0
    assert len(commands) == 2 * len(diffusion_bench.CELLS)
    for cmd in commands:
        command, argv = cmd[3], cmd[4:]
        if command == "pretrain":
            parse_pretrain(argv)
        else:
            assert command == "perplexity"
            perplexity_parser().parse_args(argv)
    one_stream = next(c for c in commands if c[3] == "pretrain" and "single_stream" in c and "bd3lm" in c)
    assert ("--masked_form", "single_stream") in zip(one_stream, one_stream[1:])


def test_adapt_bench_smoke_sizes_give_way_to_the_command_line():
    argv = ["eval", "--source", "s", "--eval_file", "v", "--out", "o"]
    args = adapt_bench.parse_args([*argv, "--smoke", "--prompts", "5"])
    assert args.prompts == 5 and args.new_tokens == adapt_bench.SMOKE_EVAL["new_tokens"] != 128
    assert adapt_bench.parse_args(argv).new_tokens == 128
    with pytest.raises(SystemExit):  # neither a subcommand nor --smoke --out
        adapt_bench.parse_args(["--smoke"])
