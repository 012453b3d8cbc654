"""One cell of the learning curves (issue 32), in its own process: ``python study_curves_cell.py spec.json``.

Loop until the deadline: evaluate every saved checkpoint that has no record yet (if the evaluation can end before
the deadline), then pretrain from the latest checkpoint to the next one (or to the deadline, where it saves a
resumable checkpoint and exits), then, after the last checkpoint's record, fine-tune the four tasks (one task at a
time, each kept, so a later command goes on with the rest). A record is written atomically when its evaluation
ends: a command killed at its limit never loses one. The next command resumes from ``cell_dir``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import multiprocessing
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from study_common import TASKS, round_sig, versions, write_json

DONE_MARK = "curves_checkpoint_complete"


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
def checkpoints(cell_dir: Path) -> dict[int, Path]:
    """Complete checkpoints (step -> folder): those holding the marker written after the save returned."""
    root = Path(cell_dir) / "pretrain"
    found = {}
    for folder in root.glob("checkpoint-*") if root.is_dir() else []:
        if (folder / DONE_MARK).is_file():
            found[int(folder.name.split("-")[1])] = folder
    return dict(sorted(found.items()))


def drop_incomplete(cell_dir: Path) -> None:
    root = Path(cell_dir) / "pretrain"
    for folder in root.glob("checkpoint-*") if root.is_dir() else []:
        if not (folder / DONE_MARK).is_file():
            shutil.rmtree(folder, ignore_errors=True)


def prune(cell_dir: Path, keep: set[int]) -> None:
    """Remove checkpoints not in ``keep`` (the latest, and those whose evaluation or fine-tuning is pending)."""
    for step, folder in checkpoints(cell_dir).items():
        if step not in keep:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# pretraining, segment by segment
# ---------------------------------------------------------------------------------------------
def objective_arguments(pretrain_args: list[str]):
    """The protocol's ``hf-lookaround pretrain`` objective arguments, parsed as the CLI parses them."""
    from transformers import HfArgumentParser

    from hf_lookaround.training.pretraining import ObjectiveArguments

    (objective_args,) = HfArgumentParser(ObjectiveArguments).parse_args_into_dataclasses(
        args=list(pretrain_args), return_remaining_strings=False)
    return objective_args


def _stop_callback(target_step: int, deadline_unix: float):
    from transformers import TrainerCallback

    class StopAtCheckpointOrDeadline(TrainerCallback):
        """Save and stop at the next checkpoint's step, or at the deadline (a resumable checkpoint)."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= target_step or time.time() >= deadline_unix:
                control.should_save = True
                control.should_training_stop = True
            return control

    return StopAtCheckpointOrDeadline()


def build_trainer(spec, tokenizer, target_step: int, eval_blocks=None):
    import datasets

    from study_cell import _training_args

    # the module, not its names: the assembly test replaces ``pretraining.build_trainer``
    from hf_lookaround.training import pretraining as P
    s, seed = spec["settings"], spec["seed"]
    objective_args = objective_arguments(spec["pretrain_args"])
    model_args = P.ModelArguments(preset=s["preset"])
    config = P.build_config(model_args, objective_args, tokenizer, s["block_size"])
    steps = spec["checkpoint_steps"][-1]
    args = _training_args(
        Path(spec["cell_dir"]) / "pretrain", seed, spec["device"], pretraining=True, max_steps=steps,
        per_device_train_batch_size=s["batch_size"], learning_rate=spec["learning_rate"], lr_scheduler_type="cosine",
        warmup_steps=max(1, int(spec["warmup_fraction"] * steps)), weight_decay=0.01, adam_beta2=0.98,
        max_grad_norm=1.0, logging_steps=max(1, steps // 50), save_only_model=False,
        # the recorded curves trained every batch whole: the unread-content policy stays off unless a cell asks
        drop_unread_content=s.get("drop_unread_content", False))
    # the package's one training assembly (the initial weights of this seed, its collators, the Trainer)
    return P.build_trainer(config, model_args, objective_args, args, tokenizer,
                           datasets.load_from_disk(spec["prep"]["train_blocks"]), eval_blocks, block_size=s["block_size"],
                           callbacks=[_stop_callback(target_step, spec["deadline_unix"])])


def pretrain_segment(spec, tokenizer, target_step: int, log) -> dict:
    """From the latest complete checkpoint to ``target_step`` (or the deadline); marks the saved checkpoint."""
    trainer = build_trainer(spec, tokenizer, target_step)
    latest = max(checkpoints(spec["cell_dir"]), default=None)
    resume = str(checkpoints(spec["cell_dir"])[latest]) if latest is not None else None
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    step = trainer.state.global_step
    folder = Path(spec["cell_dir"]) / "pretrain" / f"checkpoint-{step}"
    if not folder.is_dir():  # the save did not happen (e.g. no step was taken)
        trainer.save_model(str(folder))
        trainer.state.save_to_json(str(folder / "trainer_state.json"))
    tokenizer.save_pretrained(str(folder))
    (folder / DONE_MARK).write_text(json.dumps({"step": step}))
    s = spec["settings"]
    done_steps = step - (latest or 0)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    info = {"from_step": latest or 0, "to_step": step, "seconds": seconds, "resumed": resume is not None,
            "tokens_per_second": done_steps * s["batch_size"] * s["block_size"] / seconds if seconds else None,
            "last_logged_loss": losses[-1] if losses else None, "command_label": spec["command_label"],
            "gpu": spec["gpu"]}
    log(f"pretrained steps {info['from_step']}..{step} in {seconds:.0f} s")
    return round_sig(info)


# ---------------------------------------------------------------------------------------------
# evaluation of one checkpoint
# ---------------------------------------------------------------------------------------------
def load_model(folder: Path, spec):
    from transformers import AutoTokenizer

    from hf_lookaround.training import pretraining as P

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    objective_args = objective_arguments(spec["pretrain_args"])
    model_args = P.ModelArguments(preset=spec["settings"]["preset"])
    config = P.build_config(model_args, objective_args, tokenizer, spec["settings"]["block_size"])
    model = type(P.build_model(config, model_args, objective_args)).from_pretrained(str(folder))
    return model.to(spec["device"]).eval(), tokenizer


def full_length_perplexity(model, tokenizer, spec) -> dict:
    from study_cell import per_passage, scored_tokens_per_text
    from study_common import HELDOUT_SETS, PREFIX_BUCKETS

    from hf_lookaround.evaluation.perplexity import bucket_by_prefix_length, full_length_masked_nlls

    s = spec["settings"]
    heldout = json.loads(Path(spec["prep"]["heldout"]).read_text())
    out = {}
    for name in HELDOUT_SETS:
        nlls, prefixes = full_length_masked_nlls(model, tokenizer, heldout[name], max_length=s["block_size"],
                                                 stride=s["block_size"] // 2, batch_size=s["eval_batch_size"])
        out[name] = round_sig({"nll": float(nlls.mean()), "num_tokens": int(nlls.size),
                               "by_prefix_length": bucket_by_prefix_length(nlls, prefixes, PREFIX_BUCKETS),
                               "per_passage": per_passage(nlls, prefixes, scored_tokens_per_text(tokenizer, heldout[name]))})
    return out


def one_stream_perplexity(model, tokenizer, spec, log) -> dict:
    """dar's one-stream form under the AR protocol, p(x_k | x_<k) (``ar_perplexity``: one layout per first-group
    size), recorded as ``ar_plan`` in the same form as the two-stream cells' (``study_cell.perplexity``)."""
    from study_cell import per_passage, scored_tokens_per_text
    from study_common import HELDOUT_SETS, PREFIX_BUCKETS

    from hf_lookaround.evaluation import perplexity as M

    s = spec["settings"]
    heldout = json.loads(Path(spec["prep"]["heldout"]).read_text())
    out = {"natural_protocol": "ar_plan", "sets": {}}
    for name in HELDOUT_SETS:
        r = M.ar_perplexity(model, tokenizer, heldout[name], max_length=s["block_size"], stride=s["block_size"] // 2,
                            batch_size=s["eval_batch_size"])
        out["sets"][name] = {"ar_plan": round_sig({
            "perplexity": r.perplexity, "nll": r.mean_nll, "bits_per_byte": r.bits_per_byte,
            "num_tokens": r.num_tokens, "num_bytes": int(r.num_bytes), "num_passages": len(heldout[name]),
            "by_prefix_length": M.bucket_by_prefix_length(r.nlls, r.prefix_lengths, PREFIX_BUCKETS),
            "per_passage": per_passage(r.nlls, r.prefix_lengths, scored_tokens_per_text(tokenizer, heldout[name])),
        })}
        log(f"perplexity {name}: ar_plan (one stream) {r.perplexity:.1f}")
    return out


def evaluate(model, tokenizer, spec, log, folder: Path | None = None) -> dict:
    """Perplexity (both protocols, and full-length where the protocol asks), probes; a protocol the model cannot
    run is named in ``skipped``. With ``--second_scorer lm_eval``, lm-evaluation-harness also scores the AR
    protocol's held-out passages from the checkpoint ``folder`` (``study_curves_lm_eval``)."""
    import study_cell

    from hf_lookaround.evaluation.perplexity import is_two_stream
    from hf_lookaround.decoding import is_one_stream_group_model

    out, skipped = {}, {}
    if not spec.get("perplexity", True):
        skipped["perplexity"] = "the protocol asks for no perplexity (evaluation.perplexity = false)"
    elif is_one_stream_group_model(model.config):
        out["perplexity"] = one_stream_perplexity(model, tokenizer, spec, log)
        skipped["masked_prefix"] = "dar's one-stream form is block-causal: it has no bidirectional prefix to mask"
    elif is_two_stream(model):
        out["perplexity"] = study_cell.perplexity(model, tokenizer, spec, log)
        if spec["full_length"]:
            for name, entry in full_length_perplexity(model, tokenizer, spec).items():
                out["perplexity"]["sets"][name]["full_length"] = entry
    else:
        skipped["perplexity"] = f"{type(model).__name__} is not two-stream: the study's protocols need the query stream"
    out["perplexity_documents"] = json.loads(Path(spec["prep"]["heldout_documents"]).read_text())
    out["probe"] = study_cell.probes(model, tokenizer, spec, log)
    out["skipped"] = skipped
    if spec.get("second_scorer") == "lm_eval":
        import study_curves_lm_eval

        out["second_scorer"] = study_curves_lm_eval.score(model, tokenizer, folder, spec, log)
    return out


def write_record(spec, tokens: int, step: int, measures: dict, seconds: float, pretrain: list) -> Path:
    from study_curves import record_name

    record = {"key": spec["key"], "objective": spec["objective"], "seed": spec["seed"], "tokens": tokens,
              "step": step, "code_commit": spec["code_commit"], "protocol_sha256": spec["protocol_sha256"],
              "part": spec["part"], "command_label": spec["command_label"], "gpu": spec["gpu"],
              "learning_rate": spec["learning_rate"], "pretrain_args": spec["pretrain_args"],
              "eval_seconds": round_sig(seconds), "pretrain_segments": pretrain, "versions": versions(),
              "training_slice_sha256": spec["prep"].get("training_slice_sha256"), "cell_run": spec.get("cell_run"),
              "finished_unix": time.time(), **measures}
    path = Path(spec["records_dir"]) / record_name(spec["key"], tokens)
    write_json(path, record)  # atomic: a temporary file, then a rename
    return path


# ---------------------------------------------------------------------------------------------
# fine-tuning at the last checkpoint, task by task
# ---------------------------------------------------------------------------------------------
def _die_with_the_cell() -> None:
    """A rate worker ends when its cell's process does (killed at a deadline, say), never left on the GPU."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _finetune_rate(folder: str, spec: dict, task: str, lr: float, threads: int) -> dict:
    """One rate of a task's grid in a process of its own (``rate_runner``'s job)."""
    import torch

    from study_cell import finetune_one

    torch.set_num_threads(threads)
    return finetune_one(Path(folder), spec, task, "full", lr, functools.partial(print, f"{spec['key']}:", flush=True))


@contextlib.contextmanager
def rate_runner(spec: dict, folder: Path, grid: list[float], log):
    """Yields ``run(task) -> {rate: result}``: a task's fine-tuning at every rate of the grid, one after another,
    or ``rate_processes`` at once in worker processes kept for the cell.

    Each rate is an independent, seeded run, so where it runs does not change its result. At once is faster where
    fine-tuning a small model is bound by the host and kernel launches rather than the GPU (study18: 12 fine-tuning
    processes on one H100 each ran as fast as one alone)."""
    from study_cell import finetune_one

    workers = min(int(spec.get("rate_processes", 1)), len(grid))
    if workers <= 1:
        yield lambda task: {lr: finetune_one(folder, spec, task, "full", lr, log) for lr in grid}
        return
    threads = max(1, spec["threads"] // workers)
    # spawn: the cell's process has CUDA initialised by pretraining, which a forked child cannot use
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_die_with_the_cell) as pool:
        def run(task: str) -> dict[float, dict]:
            jobs = {lr: pool.submit(_finetune_rate, str(folder), spec, task, lr, threads) for lr in grid}
            return {lr: job.result() for lr, job in jobs.items()}

        yield run


def finetune_tasks(spec, folder: Path, log) -> bool:
    """Every task not yet fine-tuned (kept in ``finetune_partial.json``); the record once all four are done."""
    from study_cell import select_learning_rate
    from study_curves import finetune_name

    partial_path = Path(spec["cell_dir"]) / "finetune_partial.json"
    done = json.loads(partial_path.read_text()) if partial_path.is_file() else {}
    longest = max([d["seconds"] for d in done.values()], default=spec["eval_minutes_guess"] * 60)
    grid = [float(lr) for lr in spec["settings"]["ft_lrs"]]
    with rate_runner(spec, folder, grid, log) as fine_tune_rates:
        for task in [t for t in TASKS if t not in done]:
            if time.time() + 1.2 * longest > spec["deadline_unix"]:
                log(f"fine-tune {task}: left for the next command (time)")
                return False
            start = time.perf_counter()
            runs = fine_tune_rates(task)
            best = select_learning_rate({lr: r["validation"] for lr, r in runs.items()})
            chosen = runs[best]
            done[task] = round_sig({"metric": chosen["metric"], "learning_rate": best,
                                    "validation": chosen["validation"], "test": chosen["test"],
                                    "test_predictions": chosen["test_predictions"],
                                    "test_labels": chosen["test_labels"], "seconds": time.perf_counter() - start,
                                    "validation_by_lr": {f"{lr:g}": r["validation"] for lr, r in runs.items()}})
            longest = max(longest, done[task]["seconds"])
            write_json(partial_path, done)
    record = {"key": spec["key"], "objective": spec["objective"], "seed": spec["seed"], "kind": "finetune",
              "tokens": spec["checkpoint_tokens"][-1], "code_commit": spec["code_commit"],
              "protocol_sha256": spec["protocol_sha256"], "part": spec["part"],
              "command_label": spec["command_label"], "finetune": {"full": done}, "finished_unix": time.time(),
              "gpu": spec["gpu"], "versions": versions(), "learning_rate": spec["learning_rate"],
              "features": spec.get("features", "content_last_layer"),
              "rate_processes": spec.get("rate_processes", 1),
              "training_slice_sha256": spec["prep"].get("training_slice_sha256"), "cell_run": spec.get("cell_run")}
    write_json(Path(spec["records_dir"]) / finetune_name(spec["key"]), record)
    return True


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def _pending_evaluation(spec, saved: dict[int, Path]):
    """The first checkpoint (tokens, step) that is saved and has no record."""
    from study_curves import record_name

    for tokens, step in zip(spec["checkpoint_tokens"], spec["checkpoint_steps"]):
        if step in saved and not (Path(spec["records_dir"]) / record_name(spec["key"], tokens)).is_file():
            return tokens, step
    return None


def _next_target(spec, saved: dict[int, Path]):
    latest = max(saved, default=0)
    return next((s for s in spec["checkpoint_steps"] if s > latest), None)


def run(spec: dict, log) -> str:
    """Returns the state the cell is left in: "finished", "deadline" (to resume) or "paused for time"."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["prep"]["tokenizer"])
    drop_incomplete(spec["cell_dir"])
    # one run of the cell: from step 0 on this machine's disk to its last record; a lost machine means a new run
    run_path = Path(spec["cell_dir"]) / "cell_run.json"
    if not run_path.is_file():
        write_json(run_path, {"cell_run": f"{spec['command_label']}-gpu{spec['gpu']}-{time.time():.0f}"})
    spec["cell_run"] = json.loads(run_path.read_text())["cell_run"]
    state_path = Path(spec["cell_dir"]) / "segments.json"
    segments = json.loads(state_path.read_text()) if state_path.is_file() else []
    eval_seconds = spec["eval_minutes_guess"] * 60
    steps_left = spec.get("steps_this_command")  # None: until the deadline
    while True:
        saved = checkpoints(spec["cell_dir"])
        pending = _pending_evaluation(spec, saved)
        if pending is not None:
            if time.time() + 1.2 * eval_seconds > spec["deadline_unix"]:
                return "paused for time (evaluation left for the next command)"
            tokens, step = pending
            start = time.perf_counter()
            model, tok = load_model(saved[step], spec)
            measures = evaluate(model, tok, spec, log, saved[step])
            eval_seconds = time.perf_counter() - start
            write_record(spec, tokens, step, measures, eval_seconds, segments)
            log(f"evaluated {tokens:,} tokens in {eval_seconds:.0f} s")
            del model
            continue
        target = _next_target(spec, saved)
        if target is None:
            last = saved[spec["checkpoint_steps"][-1]]
            prune(spec["cell_dir"], {spec["checkpoint_steps"][-1]})
            if spec["finetune"] and not finetune_tasks(spec, last, log):
                return "paused for time (fine-tuning left for the next command)"
            return "finished"
        if time.time() >= spec["deadline_unix"] or steps_left == 0:
            return "deadline"
        if steps_left is not None:
            target = min(target, max(saved, default=0) + steps_left)
        segments.append(pretrain_segment(spec, tokenizer, target, log))
        if steps_left is not None:
            steps_left -= segments[-1]["to_step"] - segments[-1]["from_step"]
        write_json(state_path, segments)
        prune(spec["cell_dir"], {max(checkpoints(spec["cell_dir"]))} | set(spec["checkpoint_steps"]))


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {spec['key']}: {msg}", flush=True)

    state = run(spec, log)
    log(f"left {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
