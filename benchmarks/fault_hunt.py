"""Kill ``hf-lookaround pretrain`` at random moments and during saves; check what a resume makes of it.

    python benchmarks/fault_hunt.py --trials 24 --objectives ar dar mlm gvp

For every objective, one uninterrupted run is the reference. Each trial then starts the same run in a fresh
folder and SIGKILLs the ``pretrain`` process, either

- ``step``: at a random moment of its life: during start-up (a random time before the first step), or a random
  fraction of a second after training step ``s`` was logged (inside the next step, or a save), or
- ``file k``: inside the save of a random ``checkpoint-N`` (the final save included), as soon as its folder
  holds ``k`` files (the parent polls the folder, so the process may have written a little more by the time
  the signal lands: the table shows the files that were there), or
- ``write name``: as soon as one named file of a save appears (it may be half written): a checkpoint's
  ``rng_state.pth`` or ``scheduler.pt``, or the final top-level ``model.safetensors``,

then resumes it as a user would (``--resume_from_checkpoint last`` when a complete checkpoint exists, else
``--overwrite_output_dir``), possibly killing it again (``--kills``), until a run finishes. Reported per trial:
what the resume started from, whether that checkpoint was complete and intact, and the largest absolute
difference between the final weights and the reference's (0 = bit-identical).

A tiny model on a synthetic corpus, on the CPU: 24 trials take a few minutes. Needs this package (``src/``
on ``PYTHONPATH`` or installed), torch, transformers, datasets, safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,hidden_dropout_prob=0.1"
WORDS = ("river stone light window garden morning paper story market winter music number table city road "
         "green quiet early simple open bright cold warm small large old new first last long short").split()


def write_corpus(folder: Path, documents: int = 60, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = folder / "corpus.jsonl"
    with open(path, "w") as f:
        for _ in range(documents):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def pretrain_args(corpus: Path, tokenizer: Path, out: Path, objective: str, steps: int, save_steps: int,
                  extra=()) -> list[str]:
    return [
        "pretrain", "--train_files", str(corpus), "--tokenizer_name", str(tokenizer), "--preset", "tiny",
        "--config_overrides", TINY, "--block_size", "32", "--objective", objective, "--output_dir", str(out),
        "--do_train", "--max_steps", str(steps), "--save_steps", str(save_steps), "--save_total_limit", "2",
        "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--logging_steps", "1", "--seed", "7",
        "--report_to", "none", "--disable_tqdm", "true", "--validation_split_percentage", "0", *extra,
    ]


def env() -> dict:
    # unbuffered: the parent reads the step logs as they are written
    e = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [e.get("PYTHONPATH")])])
    return e


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "hf_lookaround.cli", *args]


def run_to_end(args: list[str], log: Path) -> int:
    with open(log, "a") as f:
        return subprocess.run(command(args), env=env(), stdout=f, stderr=subprocess.STDOUT).returncode


def files_in(folder: Path) -> int:
    try:
        return sum(1 for _ in folder.iterdir())
    except FileNotFoundError:
        return 0


def run_and_kill(args: list[str], log: Path, out: Path, kill: tuple) -> str:
    """Start the run, SIGKILL it at ``kill``: ``("time", seconds)`` after its start, ``("step", s, delay)``
    (``delay`` seconds after the ``s``-th training loss of this process is logged), or ``("file", k, step)``
    (``k`` files in ``checkpoint-step``; step 0: the final save into ``out``), or ``("write", name, step)`` (the
    file ``name`` appears in ``checkpoint-step``; step 0: in ``out``); say where it died."""
    offset = log.stat().st_size if log.exists() else 0
    with open(log, "a") as f:
        proc = subprocess.Popen(command(args), env=env(), stdout=f, stderr=subprocess.STDOUT)
        start = time.monotonic()
        where, seen_at = None, None
        while proc.poll() is None:
            if kill[0] == "time" and time.monotonic() - start >= kill[1]:
                where = f"t={kill[1]:.1f}s (start-up)"
            elif kill[0] == "step":
                if seen_at is None:
                    with open(log) as g:
                        g.seek(offset)
                        if g.read().count("'loss':") >= kill[1]:
                            seen_at = time.monotonic()
                elif time.monotonic() - seen_at >= kill[2]:
                    where = f"{kill[2]:.2f}s after step {kill[1]}"
            elif kill[0] == "file":
                if kill[2]:
                    folder = out / f"checkpoint-{kill[2]}"
                    n = files_in(folder)
                    if n >= kill[1]:
                        where = f"checkpoint-{kill[2]}, {n} file(s)"
                elif (out / "model.safetensors").exists() or (out / "config.json").exists():
                    n = sum((out / name).exists() for name in FINAL_FILES)
                    if n >= min(kill[1], len(FINAL_FILES)):
                        where = f"final save, {n} file(s)"
            elif kill[0] == "write":
                folder = out / f"checkpoint-{kill[2]}" if kill[2] else out
                if (folder / kill[1]).exists():
                    where = f"{'checkpoint-' + str(kill[2]) if kill[2] else 'final save'}, writing {kill[1]}"
            if where:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return where
            time.sleep(0.0005 if kill[0] in ("file", "write") else 0.005)
    return f"finished first (rc {proc.returncode})"


# what the final save writes into output_dir, in about that order
FINAL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "training_args.bin", "train_results.json",
               "all_results.json", "trainer_state.json", "README.md")


def final_weights(out: Path):
    from safetensors.torch import load_file

    path = out / "model.safetensors"
    return load_file(path) if path.is_file() else None


def max_abs_diff(a, b) -> float:
    if a is None or b is None:
        return float("nan")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def resume_point(log_text: str) -> str:
    """What the last resume of the log started from."""
    found = re.findall(r"resuming from (\S+?),? the newest complete checkpoint", log_text)
    if found:
        return Path(found[-1]).name
    if "nothing to train" in log_text:
        return "finished run"
    return "scratch"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--objectives", nargs="+", default=["ar", "dar", "mlm", "gvp"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--kills", type=int, default=2, help="most kills per trial (a chain), 1 = kill once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--extra", default="", help="more pretrain arguments, in one string (e.g. evaluation)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    extra = args.extra.split()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fault_hunt_"))
    work.mkdir(parents=True, exist_ok=True)

    sys.path.insert(0, str(ROOT / "src"))
    from hf_lookaround.data.tokenization import train_tokenizer
    from hf_lookaround.training import checkpointing

    corpus = write_corpus(work)
    tokenizer = work / "tokenizer"
    train_tokenizer([json.loads(line)["text"] for line in corpus.read_text().splitlines()], vocab_size=300,
                    output_dir=tokenizer)

    references, durations = {}, {}
    for objective in args.objectives:
        out = work / f"reference-{objective}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.monotonic()
        rc = run_to_end(pretrain_args(corpus, tokenizer, out, objective, args.steps, args.save_steps, extra),
                        work / f"{out.name}.log")
        durations[objective] = time.monotonic() - start
        if rc:
            sys.exit(f"the reference run of {objective} failed (rc {rc}): see {work / out.name}.log")
        references[objective] = final_weights(out)
        print(f"reference {objective}: {durations[objective]:.1f} s", flush=True)

    rows = []
    for trial in range(args.trials):
        objective = args.objectives[trial % len(args.objectives)]
        out, log = work / f"trial{trial:02d}-{objective}", work / f"trial{trial:02d}-{objective}.log"
        shutil.rmtree(out, ignore_errors=True)
        log.unlink(missing_ok=True)
        base = pretrain_args(corpus, tokenizer, out, objective, args.steps, args.save_steps, extra)
        kills, states, starts = [], [], []
        first = True
        for _ in range(rng.randint(1, args.kills)):
            last = checkpointing.last_complete_checkpoint(out) if not first else None
            done_step = int(last.name.split("-")[1]) if last is not None else 0  # where this run starts
            if trial % 2 == 0:  # a random moment of the run's life: start-up, or inside a step or a save
                step = rng.randint(0, max(args.steps - done_step, 1))  # the steps this run logs
                kill = ("time", rng.uniform(0.5, 5.0)) if step == 0 else ("step", step, rng.uniform(0.0, 0.4))
            else:  # at a file boundary of a save this run makes (a checkpoint holds about a dozen files), 0: final
                saves = [*range(done_step + args.save_steps, args.steps + 1, args.save_steps), 0]
                save = rng.choice(saves)
                if rng.random() < 0.5:  # or as one named file of it appears: the RNG state, the schedule, final weights
                    kill = ("write", rng.choice(["rng_state.pth", "scheduler.pt"]) if save else "model.safetensors", save)
                else:
                    kill = ("file", rng.randint(1, 12), save)
            resume = base if first else base + resume_flags(out)
            kills.append(run_and_kill(resume, log, out, kill))
            first = False
            done = checkpointing.complete_checkpoints(out)
            states.append(f"{len(done)} complete" + (f" (last {done[-1].name})" if done else ""))
        flags = resume_flags(out)
        last = checkpointing.last_complete_checkpoint(out)
        intact = last is None or not checkpointing.checkpoint_problems(last)
        before = log.read_text() if log.is_file() else ""
        rc = run_to_end(base + flags, log)
        text = log.read_text()[len(before):]
        diff = max_abs_diff(final_weights(out), references[objective])
        rows.append({
            "trial": trial, "objective": objective, "kills": kills, "on disk": states[-1],
            "resumed from": resume_point(text), "intact": intact, "rc": rc, "max abs diff": diff,
        })
        print(format_row(rows[-1]), flush=True)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


def resume_flags(out: Path) -> list[str]:
    from hf_lookaround.training import checkpointing

    if checkpointing.last_complete_checkpoint(out) is not None:
        return ["--resume_from_checkpoint", "last"]
    return ["--overwrite_output_dir"]  # nothing complete to resume from: start again


def format_row(r: dict) -> str:
    return (f"| {r['trial']} | {r['objective']} | {'; '.join(r['kills'])} | {r['on disk']} | {r['resumed from']} | "
            f"{'yes' if r['intact'] else 'NO'} | {r['rc']} | {r['max abs diff']:.3g} |")


def table(rows: list[dict]) -> str:
    head = ("| trial | objective | killed at | complete checkpoints then | resumed from | intact | rc | "
            "max abs diff vs uninterrupted |\n|---|---|---|---|---|---|---|---|")
    lines = [head, *map(format_row, rows)]
    same = sum(r["max abs diff"] == 0 for r in rows)
    ok = sum(r["rc"] == 0 and r["intact"] for r in rows)
    worst = max((r["max abs diff"] for r in rows), default=0.0)
    lines.append(f"\n{ok}/{len(rows)} resumed from an intact complete checkpoint (or from scratch) and finished; "
                 f"{same}/{len(rows)} bit-identical to the uninterrupted run; largest difference {worst:.3g}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
