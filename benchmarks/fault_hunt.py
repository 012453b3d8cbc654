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

``--battery`` runs the hostile inputs of :data:`BATTERY` instead (bad data records, nonsense values, another
objective's flags, a diverging run, damaged checkpoints, markers and tokenizers, checkpoints lm-eval must refuse),
each as its own process, and checks that each ends in exit status 2 and the one line expected, or (the cards of a
one-stream run and of a LoRA fine-tune) that it succeeds and writes what it should (tests/test_faults_battery.py
asserts the same in-process).

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
    parser.add_argument("--battery", action="store_true",
                        help="run the battery of hostile inputs instead (each must end in one expected line)")
    args = parser.parse_args(argv)
    if args.battery:
        sys.path.insert(0, str(ROOT / "src"))
        work = Path(args.workdir or tempfile.mkdtemp(prefix="fault_battery_"))
        rows = run_battery(work)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        sys.exit(0 if all(r["ok"] for r in rows) else 1)
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


# ---------------------------------------------------------------------------------------------
# The battery: hostile inputs, each with the one line it must end in (rc 2, no traceback). Run on the CPU in a
# minute or two: python benchmarks/fault_hunt.py --battery. tests/test_faults_battery.py asserts every case.
# ---------------------------------------------------------------------------------------------
class Case:
    """One hostile input: ``argv(ctx)`` the command line (``ctx``: the paths of :func:`battery_fixtures`), and
    ``expect(ctx)`` the substrings its one error line must hold (exit status 2). With ``reads(ctx)`` (a file the
    command writes), the command must succeed instead, and that file hold every ``expect`` substring and none of
    ``absent(ctx)``'s (a card that says what its checkpoint is). ``needs``: a module without which the case is
    skipped (lm-eval is an optional extra)."""

    def __init__(self, name: str, argv, expect, reads=None, absent=lambda c: [], needs: str | None = None):
        self.name, self.argv, self.expect = name, argv, expect
        self.reads, self.absent, self.needs = reads, absent, needs

    def runnable(self) -> bool:
        import importlib.util

        return self.needs is None or importlib.util.find_spec(self.needs) is not None

    def problems_in(self, ctx) -> list[str]:
        """For a ``reads`` case, after the command ran: what the file lacks or holds that it must not."""
        path = self.reads(ctx)
        if not path.is_file():
            return [f"{path} was not written"]
        text = " ".join(path.read_text().split())
        return ([f"lacks {part!r}" for part in self.expect(ctx) if part not in text]
                + [f"holds {part!r}" for part in self.absent(ctx) if part in text])


def _pretrain(ctx, data="good.jsonl", *extra, out="run-bad"):
    return ["pretrain", "--train_files", str(ctx["data"] / data), "--tokenizer_name", str(ctx["tokenizer"]),
            "--preset", "tiny", "--config_overrides", TINY, "--block_size", "16", "--do_train", "--max_steps", "4",
            "--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
            "--validation_split_percentage", "0", "--output_dir", str(ctx["work"] / out), *extra]


def _tokenizer(ctx, data, *extra):
    return ["train-tokenizer", str(ctx["data"] / data), "-o", str(ctx["work"] / "tok-bad"), "--vocab_size", "300",
            *extra]


def _perplexity(ctx, data="good.jsonl", *extra):
    return ["perplexity", "--model_name_or_path", str(ctx["run"]), "--dataset", str(ctx["data"] / data),
            "--device", "cpu", "--output_dir", str(ctx["work"] / "ppl-bad"), *extra]


def _generate(ctx, *extra, model=None):
    return ["generate", str(model or ctx["run"]), "--num_tokens", "3", "--device", "cpu", *extra]


def _in(ctx, name):
    return str(ctx["data"] / name)


def _lm_eval(ctx, model, *extra):
    return ["lm-eval", "--model_args", f"pretrained={model}", *extra, "--include_path", str(ctx["data"] / "tasks"),
            "--tasks", "battery_rolling", "--device", "cpu"]


def _glue(ctx):
    reviews = ctx["data"] / "reviews"
    return ["glue", "--model_name_or_path", str(ctx["run"]), "--train_file", str(reviews / "train.jsonl"),
            "--validation_file", str(reviews / "validation.jsonl"), "--test_file", str(reviews / "test.jsonl"),
            "--max_seq_length", "16", "--max_steps", "1", "--per_device_train_batch_size", "4", "--do_train",
            "--do_eval", "--do_predict", "--use_lora", "--report_to", "none", "--save_strategy", "no", "--use_cpu",
            "--disable_tqdm", "true", "--output_dir", str(ctx["work"] / "glue")]


BATTERY = [
    # data records: checked by data/records.py before any library sees them
    Case("bare number line, train-tokenizer", lambda c: _tokenizer(c, "bare.jsonl"),
         lambda c: [f"{_in(c, 'bare.jsonl')}:2:", "must be a JSON object", "not a number"]),
    Case("null line, pretrain", lambda c: _pretrain(c, "null.jsonl"),
         lambda c: [f"{_in(c, 'null.jsonl')}:2:", "must be a JSON object", "not null"]),
    Case("bare number line, perplexity", lambda c: _perplexity(c, "bare.jsonl"),
         lambda c: [f"{_in(c, 'bare.jsonl')}:2:", "must be a JSON object"]),
    Case("text 5, perplexity", lambda c: _perplexity(c, "number_text.jsonl"),
         lambda c: [f"{_in(c, 'number_text.jsonl')}:2:", "holds a number, not a string"]),
    Case("list text, train-tokenizer", lambda c: _tokenizer(c, "list_text.jsonl"),
         lambda c: [f"{_in(c, 'list_text.jsonl')}:2:", "holds a list, not a string"]),
    Case("dict text, pretrain", lambda c: _pretrain(c, "dict_text.jsonl"),
         lambda c: [f"{_in(c, 'dict_text.jsonl')}:2:", "holds an object, not a string"]),
    Case("record without text after the first, perplexity", lambda c: _perplexity(c, "missing_text.jsonl"),
         lambda c: [_in(c, "missing_text.jsonl"), "1 record(s) hold no 'text'", "lines 3"]),
    Case("100,000 nested brackets, pretrain", lambda c: _pretrain(c, "deep.jsonl"),
         lambda c: [f"{_in(c, 'deep.jsonl')}:2:", "nested deeper than"]),
    Case("5,000 nested brackets, train-tokenizer", lambda c: _tokenizer(c, "deep5000.jsonl"),
         lambda c: [f"{_in(c, 'deep5000.jsonl')}:1:", "nested deeper than"]),
    Case("gzip cut in half, train-tokenizer", lambda c: _tokenizer(c, "cut.jsonl.gz"),
         lambda c: [_in(c, "cut.jsonl.gz"), "gzip stream is cut short"]),
    Case("gzip cut in half, perplexity", lambda c: _perplexity(c, "cut.jsonl.gz"),
         lambda c: [_in(c, "cut.jsonl.gz"), "gzip stream is cut short"]),
    Case("gzip cut in half, pretrain", lambda c: _pretrain(c, "cut.jsonl.gz"),
         lambda c: [_in(c, "cut.jsonl.gz"), "gzip stream is cut short"]),
    Case("probe, cut last line", lambda c: ["probe", "--model_name_or_path", str(c["run"]), "--dataset",
                                            str(c["data"] / "probe_cut"), "--device", "cpu",
                                            "--output_dir", str(c["work"] / "probe-bad")],
         lambda c: [f"{c['data'] / 'probe_cut' / 'train.jsonl'}:4:", "not a JSON record"]),
    Case("invalid JSON line, train-tokenizer", lambda c: _tokenizer(c, "bad_json.jsonl"),
         lambda c: [f"{_in(c, 'bad_json.jsonl')}:2:", "not a JSON record"]),
    Case("invalid JSON line, perplexity", lambda c: _perplexity(c, "bad_json.jsonl"),
         lambda c: [f"{_in(c, 'bad_json.jsonl')}:2:", "not a JSON record"]),
    Case("non-UTF-8 byte on line 3, pretrain", lambda c: _pretrain(c, "latin1.jsonl"),
         lambda c: [f"{_in(c, 'latin1.jsonl')}:3:", "not UTF-8"]),
    Case("non-UTF-8 byte on line 3, train-tokenizer", lambda c: _tokenizer(c, "latin1.jsonl"),
         lambda c: [f"{_in(c, 'latin1.jsonl')}:3:", "not UTF-8"]),
    Case("empty file, train-tokenizer", lambda c: _tokenizer(c, "empty.jsonl"),
         lambda c: [_in(c, "empty.jsonl"), "empty"]),
    Case("empty file, perplexity", lambda c: _perplexity(c, "empty.jsonl"),
         lambda c: [_in(c, "empty.jsonl"), "empty"]),
    Case("/dev/null, pretrain", lambda c: _pretrain(c, "devnull.jsonl"),
         lambda c: [_in(c, "devnull.jsonl"), "empty", "/dev/null"]),
    # values that meant a traceback deep in a run, or quietly meant "off"
    Case("--gradient_accumulation_steps 0", lambda c: _pretrain(c, "good.jsonl", "--gradient_accumulation_steps", "0"),
         lambda c: ["--gradient_accumulation_steps 0", ">= 1"]),
    Case("--validation_split_percentage -5", lambda c: _pretrain(c, "good.jsonl", "--validation_split_percentage", "-5"),
         lambda c: ["--validation_split_percentage -5"]),
    Case("--save_steps 0", lambda c: _pretrain(c, "good.jsonl", "--save_steps", "0"), lambda c: ["--save_steps 0"]),
    Case("--save_total_limit -1", lambda c: _pretrain(c, "good.jsonl", "--save_total_limit", "-1"),
         lambda c: ["--save_total_limit -1"]),
    Case("--max_grad_norm nan", lambda c: _pretrain(c, "good.jsonl", "--max_grad_norm", "nan"),
         lambda c: ["--max_grad_norm nan"]),
    Case("--config_overrides hidden_size=abc", lambda c: _pretrain(c, "good.jsonl", "--config_overrides", "hidden_size=abc"),
         lambda c: ["--config_overrides hidden_size=abc", "'hidden_size' takes int"]),
    Case("--min_frequency -1", lambda c: _tokenizer(c, "good.jsonl", "--min_frequency", "-1"),
         lambda c: ["min_frequency", "got -1"]),
    Case("--vocab_size 1000000000", lambda c: _tokenizer(c, "good.jsonl", "--vocab_size", "1000000000"),
         lambda c: ["vocab_size", "at most 1,000,000"]),
    Case("generate --num_samples 10000000", lambda c: _generate(c, "--num_samples", "10000000"),
         lambda c: ["--num_samples 10000000"]),
    Case("generate --seed 10**23", lambda c: _generate(c, "--seed", str(10**23)), lambda c: ["--seed", "2**63"]),
    Case("perplexity --batch_size 0", lambda c: _perplexity(c, "good.jsonl", "--batch_size", "0"),
         lambda c: ["--batch_size 0"]),
    Case("perplexity --max_documents -1", lambda c: _perplexity(c, "good.jsonl", "--max_documents", "-1"),
         lambda c: ["--max_documents -1"]),
    # flags of another objective
    Case("--objective span --mask_ratio 0.9", lambda c: _pretrain(c, "good.jsonl", "--objective", "span", "--mask_ratio", "0.9"),
         lambda c: ["--mask_ratio 0.9", "not --objective span"]),
    Case("--objective vmlm --mask_ratio 0.5", lambda c: _pretrain(c, "good.jsonl", "--objective", "vmlm", "--mask_ratio", "0.5"),
         lambda c: ["--mask_ratio 0.5", "not --objective vmlm"]),
    Case("--objective ar --group_size 4", lambda c: _pretrain(c, "good.jsonl", "--objective", "ar", "--group_size", "4"),
         lambda c: ["--group_size 4", "not --objective ar"]),
    # runs and checkpoints
    Case("a run that diverges (--learning_rate 1e30)", lambda c: _pretrain(c, "good.jsonl", "--learning_rate", "1e30",
                                                                           "--save_steps", "2", out="run-nan"),
         lambda c: ["training diverged at step", "lower --learning_rate"]),
    Case("resume with a new --learning_rate", lambda c: _pretrain(c, "good.jsonl", "--resume_from_checkpoint", "last",
                                                                  "--learning_rate", "0.01", "--max_steps", "6",
                                                                  out=c["run"].name),
         lambda c: ["--learning_rate", "cannot resume"]),
    Case("missing tensors, config.json without architectures", lambda c: _generate(c, model=c["no_arch"]),
         lambda c: [str(c["no_arch"]), "missing"]),
    Case("a cut tokenizer.json", lambda c: _generate(c, "--tokenizer", str(c["cut_tokenizer"])),
         lambda c: [str(c["cut_tokenizer"] / "tokenizer.json"), "not valid JSON"]),
    # completion markers: the sha256 of each whole file finds a byte the 64 KiB sample windows never read
    Case("a checkpoint byte changed outside the sampled windows",
         lambda c: _pretrain(c, "good.jsonl", "--resume_from_checkpoint", str(c["sha256_run"] / "checkpoint-4"),
                             "--max_steps", "6", out=c["sha256_run"].name),
         lambda c: ["checkpoint-4", "optimizer.pt changed after the marker was written (its sha256 differs)"]),
    # cards that say what their checkpoint is, with the run's own results (the command succeeds)
    Case("the card of a one-stream dar run",
         lambda c: _pretrain(c, "good.jsonl", "--objective", "dar", "--dar_form", "single_stream", "--group_size", "2",
                             "--do_eval", "--validation_split_percentage", "10", "--perplexity_max_tokens", "64",
                             "--max_steps", "2", out="run-card"),
         lambda c: ["A LookAround **one-stream semi-autoregressive text model (SAT, block-causal, t = 2)",
                    "`generate()` decodes 2 tokens per forward", "read from `all_results.json` next to the checkpoint",
                    "held-out loss of the pretraining objective"],
         reads=lambda c: c["work"] / "run-card" / "README.md",
         absent=lambda c: ["two-stream text model", "No evaluation results", "probe_results.json"]),
    Case("the card of a glue (LoRA) fine-tune", _glue,
         lambda c: ["A LookAround **text classifier**", "from the base model a local checkpoint (not on the Hub)",
                    "fine-tuned with LoRA", "Fine-tuning (text classification)", "test accuracy",
                    "base_model: local"],
         reads=lambda c: c["work"] / "glue" / "README.md",
         absent=lambda c: [str(c["run"]), "Pretraining data", "held-out loss of the pretraining objective"]),
    # lm-eval: `hf-lookaround lm-eval` checks the checkpoint before the harness runs; the class refuses the rest
    Case("lm-eval, a cut weights file", lambda c: _lm_eval(c, c["cut_weights"]),
         lambda c: [str(c["cut_weights"]), "truncated or damaged", "its header says"], needs="lm_eval"),
    Case("lm-eval --model hf, a vision checkpoint", lambda c: _lm_eval(c, c["vision"], "--model", "hf"),
         lambda c: [str(c["vision"]), "lm-eval needs a text checkpoint"], needs="lm_eval"),
    Case("lm-eval, missing tensors", lambda c: _lm_eval(c, c["no_arch"]),
         lambda c: [str(c["no_arch"]), "missing"], needs="lm_eval"),
    Case("lm-eval, an unfinished run", lambda c: _lm_eval(c, c["unfinished"]),
         lambda c: [str(c["unfinished"]), "has not finished"], needs="lm_eval"),
    Case("lm-eval, NaN weights", lambda c: _lm_eval(c, c["nan_weights"]),
         lambda c: [str(c["nan_weights"]), "NaN or infinite"], needs="lm_eval"),
    Case("lm-eval, a model argument lookaround does not take",
         lambda c: _lm_eval(c, f"{c['run']},temperature_of_sea=3"),
         lambda c: ["do not take", "temperature_of_sea"], needs="lm_eval"),
]


def _write_lines(path: Path, lines) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def battery_fixtures(work: Path, run: Path | None = None) -> dict:
    """The bad data files, a tokenizer and (unless ``run`` is given) a finished tiny run the battery reads."""
    import gzip

    from safetensors.torch import load_file, save_file

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(data, documents=40)
    good = corpus.read_text().splitlines()
    (data / "good.jsonl").write_text(corpus.read_text())
    record = json.dumps({"text": "a plain document"})
    _write_lines(data / "bare.jsonl", [record, "5"])
    _write_lines(data / "null.jsonl", [record, "null"])
    _write_lines(data / "number_text.jsonl", [record, '{"text": 5}'])
    _write_lines(data / "list_text.jsonl", [record, '{"text": ["a", "b"]}'])
    _write_lines(data / "dict_text.jsonl", [good[0], '{"text": {"a": "b"}}', *good[1:]])
    _write_lines(data / "missing_text.jsonl", [record, record, '{"title": "no text"}'])
    _write_lines(data / "deep.jsonl", [good[0], "[" * 100_000 + "]" * 100_000, *good[1:]])
    _write_lines(data / "deep5000.jsonl", ['{"text": ' + "[" * 5000 + "]" * 5000 + "}"])
    _write_lines(data / "bad_json.jsonl", [record, '{"text": "cut sho'])
    (data / "latin1.jsonl").write_bytes(("\n".join(good[:2]) + "\n").encode() + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    (data / "empty.jsonl").write_text("")
    if not (data / "devnull.jsonl").exists():
        (data / "devnull.jsonl").symlink_to(os.devnull)
    packed = gzip.compress(("\n".join(good * 20) + "\n").encode())
    (data / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    probe = data / "probe_cut"
    probe.mkdir(exist_ok=True)
    rows = [json.dumps({"sentence": f"row {i}", "label": i % 2}) for i in range(4)]
    for split in ("train", "validation", "test"):
        (probe / f"{split}.jsonl").write_text("\n".join(rows)[:-5] + "\n")  # the last line cut short

    from hf_lookaround.data.tokenization import train_tokenizer

    tokenizer = work / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        train_tokenizer([json.loads(line)["text"] for line in good], vocab_size=300, output_dir=tokenizer)
    ctx = {"work": work, "data": data, "tokenizer": tokenizer}
    if run is None:
        run = work / "run"
        if not (run / "final_model_complete.json").is_file():
            from hf_lookaround import cli

            if cli.main(_pretrain(ctx, "good.jsonl", "--save_steps", "2", out="run")) != 0:
                raise RuntimeError("the battery's reference run failed")
    ctx["run"] = run
    # the run's weights less one tensor, and a config.json without `architectures`
    no_arch = work / "no_arch"
    if not no_arch.is_dir():
        shutil.copytree(run, no_arch, ignore=shutil.ignore_patterns("checkpoint-*", "*.lock", "final_model_complete.json"))
        weights = load_file(no_arch / "model.safetensors")
        weights.pop(sorted(k for k in weights if ".layers." in k)[0])
        save_file(weights, no_arch / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((no_arch / "config.json").read_text())
        config.pop("architectures", None)
        (no_arch / "config.json").write_text(json.dumps(config))
    ctx["no_arch"] = no_arch
    cut_tokenizer = work / "cut_tokenizer"
    if not cut_tokenizer.is_dir():
        shutil.copytree(tokenizer, cut_tokenizer)
        text = (cut_tokenizer / "tokenizer.json").read_text()
        (cut_tokenizer / "tokenizer.json").write_text(text[: len(text) // 2])
    ctx["cut_tokenizer"] = cut_tokenizer
    ctx.update(_damaged_copies(work, run))
    # a tiny lm-eval task (the lm-eval cases are refused before it is read) and GLUE-style sentences
    tasks = data / "tasks"
    tasks.mkdir(exist_ok=True)
    _write_lines(tasks / "battery_rolling.jsonl", good[:3])
    (tasks / "battery_rolling.yaml").write_text(json.dumps({  # JSON is YAML
        "task": "battery_rolling", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tasks / "battery_rolling.jsonl")}},
        "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}], "metadata": {"version": 1.0}}))
    reviews = data / "reviews"
    reviews.mkdir(exist_ok=True)
    for split in ("train", "validation", "test"):
        _write_lines(reviews / f"{split}.jsonl", [json.dumps({"sentence": " ".join(WORDS[i:i + 6]), "label": i % 2})
                                                  for i in range(8)])
    return ctx


def _damaged_copies(work: Path, run: Path) -> dict:
    """Copies of the finished ``run``, each damaged one way: a checkpoint byte changed where only a sha256 of the
    whole file finds it, final weights cut in half, a lock without a final marker, a NaN in the weights; and a
    tiny vision checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    from hf_lookaround.training import checkpointing

    paths = {name: work / name for name in ("sha256_run", "cut_weights", "unfinished", "nan_weights", "vision")}
    if not paths["sha256_run"].is_dir():
        shutil.copytree(run, paths["sha256_run"])
        state = paths["sha256_run"] / "checkpoint-4" / "optimizer.pt"
        size, window = state.stat().st_size, 64 << 10
        offset = (window + size // 2 - window // 2) // 2  # between the first and the middle window
        if not window <= offset < size // 2 - window // 2:
            raise RuntimeError(f"{state} ({size} bytes) is too small to change outside the sampled windows")
        data = bytearray(state.read_bytes())
        data[offset] ^= 0x40
        state.write_bytes(bytes(data))
    final_only = shutil.ignore_patterns("checkpoint-*")
    if not paths["cut_weights"].is_dir():
        shutil.copytree(run, paths["cut_weights"], ignore=final_only)
        weights = paths["cut_weights"] / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    if not paths["unfinished"].is_dir():
        shutil.copytree(run, paths["unfinished"], ignore=final_only)
        (paths["unfinished"] / checkpointing.FINAL_MARKER).unlink()
        (paths["unfinished"] / checkpointing.LOCK_FILE).write_text("{}")
    if not paths["nan_weights"].is_dir():
        shutil.copytree(run, paths["nan_weights"], ignore=final_only)
        weights = load_file(paths["nan_weights"] / "model.safetensors")
        first = sorted(k for k in weights if ".layers." in k)[0]
        weights[first] = torch.full_like(weights[first], float("nan"))
        save_file(weights, paths["nan_weights"] / "model.safetensors", metadata={"format": "pt"})
    if not paths["vision"].is_dir():
        from hf_lookaround import LookAroundViTForPreTraining
        from hf_lookaround.models.lookaround.configuration_lookaround_vit import LookAroundViTConfig

        config = LookAroundViTConfig(image_size=28, patch_size=7, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64)
        LookAroundViTForPreTraining(config).save_pretrained(paths["vision"])
    return paths


def run_battery(work: Path) -> list[dict]:
    """Each case as its own process: the rc, the last line of stderr, and whether it is the one line expected."""
    ctx = battery_fixtures(work)
    rows = []
    for case in BATTERY:
        if not case.runnable():
            print(f"| {case.name} | - | skipped | {case.needs} is not installed |", flush=True)
            continue
        proc = subprocess.run(command(case.argv(ctx)), env=env(), capture_output=True, text=True)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("hf-lookaround ")]
        line = errors[-1] if errors else (proc.stderr.strip().splitlines() or [""])[-1]
        if case.reads is not None:  # a command that must succeed, and write what it should
            problems = case.problems_in(ctx) if proc.returncode == 0 else []
            ok = proc.returncode == 0 and not problems
            line = "; ".join(problems) or (f"{case.reads(ctx).name} as expected" if ok else line)
        else:
            ok = (proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr
                  and all(part in line for part in case.expect(ctx)))
        rows.append({"case": case.name, "rc": proc.returncode, "ok": ok, "line": line})
        print(f"| {case.name} | {proc.returncode} | {'yes' if ok else 'NO'} | {line[:160]} |", flush=True)
    print(f"\n{sum(r['ok'] for r in rows)}/{len(rows)} cases end as expected (skipped: {len(BATTERY) - len(rows)})")
    return rows


if __name__ == "__main__":
    main()
