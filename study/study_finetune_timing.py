"""The timing run before the C1 protocol is fixed (issue 42): what fine-tuning costs, and dar one-stream's rate.

    # on the 4-GPU machine (study/finetune_timing_device_call.sh), at most ~7 minutes
    python study/study_finetune_timing.py --out $OUT --corpus_dir .devdata/c1/gutenberg --data_root /tmp/c1data \
        --bbc_dir /tmp/c1data/bbcnews/data
    # the CPU dry run (synthetic data, tiny sizes)
    python study/study_finetune_timing.py --tiny --out /tmp/timing

Two measurements, as jobs of one GPU each (a job waits for a free GPU and for the jobs it needs):

1. Fine-tuning wall time. A short ``small`` checkpoint (``--ckpt_steps`` of ar; the fine-tuning cost does not
   depend on how long the checkpoint trained), then each of the four sentence tasks fine-tuned from it with the
   study's settings (full fine-tuning, every rate of ``ft_lrs``, ``ft_epochs`` epochs, ``ft_batch_size``,
   ``max_seq_length``), through ``study_cell.finetune_one``, the function the cells use.
2. A learning-rate check for dar's one-stream form: ``--lr_tokens`` of pretraining (study18's sweep length) at
   each rate of ``--lrs``, with the curves' pretraining settings (``study_curves_cell.build_trainer``), and the
   held-out loss on the validation blocks; dar's two-stream form at 1e-3 beside it as the reference.

Everything goes to ``<out>/finetune_timing.json``, rewritten after every job (a job killed at the deadline is
listed with its exit code and log tail).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from study_common import DEFAULTS, LIST_DEFAULTS, REPO, SWEEP_LRS, SWEEP_TOKENS, TASKS, round_sig, utc_now, write_json

HERE = Path(__file__).resolve().parent
DAR_ONE_STREAM = ["--objective", "dar", "--group_size", "2", "--dar_form", "single_stream"]
DAR_TWO_STREAM = ["--objective", "dar", "--group_size", "2"]
AR = ["--objective", "ar"]
WARMUP_FRACTION = 0.05  # the curves protocol's


# ---------------------------------------------------------------------------------------------
# the jobs (each in its own process, one GPU)
# ---------------------------------------------------------------------------------------------
def pretrain_job(spec: dict, log) -> dict:
    """Pretrain ``spec["steps"]`` steps; the held-out loss on the validation blocks; the model saved if asked."""
    import datasets
    import torch
    from transformers import AutoTokenizer

    from study_curves_cell import build_trainer

    tokenizer = AutoTokenizer.from_pretrained(spec["prep"]["tokenizer"])
    val_blocks = datasets.load_from_disk(spec["prep"]["val_blocks"])
    trainer = build_trainer(spec, tokenizer, spec["steps"], eval_blocks=val_blocks)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    s = spec["settings"]
    steps = trainer.state.global_step
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if spec.get("save_to"):
        trainer.save_model(spec["save_to"])
        tokenizer.save_pretrained(spec["save_to"])
    out = {"pretrain_args": spec["pretrain_args"], "learning_rate": spec["learning_rate"], "steps": steps,
           "steps_planned": spec["steps"], "tokens": steps * s["batch_size"] * s["block_size"],
           "train_seconds": seconds, "tokens_per_second": steps * s["batch_size"] * s["block_size"] / seconds,
           "heldout_loss": metrics.get("eval_loss"), "heldout_blocks": len(val_blocks),
           "logged_losses": losses, "parameters": trainer.model.num_parameters()}
    if torch.cuda.is_available():
        out["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    log(f"pretrained {steps} steps in {seconds:.0f} s, held-out loss {out['heldout_loss']}")
    return out


def finetune_job(spec: dict, log) -> dict:
    """One task at every rate of the study's grid, as a cell fine-tunes it (``study_cell.finetune_one``)."""
    from study_cell import finetune_one, select_learning_rate

    start = time.perf_counter()
    runs = {}
    for lr in spec["settings"]["ft_lrs"]:
        r = finetune_one(Path(spec["checkpoint"]), spec, spec["task"], "full", float(lr), log)
        runs[f"{float(lr):g}"] = {k: r[k] for k in ("metric", "validation", "test", "seconds", "steps", "train_samples")}
    best = select_learning_rate({lr: r["validation"] for lr, r in runs.items()})
    return {"task": spec["task"], "seconds": time.perf_counter() - start, "by_lr": runs,
            "selected_lr": best, "settings": {k: spec["settings"][k] for k in
                                              ("ft_lrs", "ft_epochs", "ft_batch_size", "max_seq_length", "ft_train")}}


def run_job(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from transformers.utils import logging as hf_logging

    from study_common import versions

    hf_logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {spec['name']}: {msg}", flush=True)

    result = (pretrain_job if spec["kind"] == "pretrain" else finetune_job)(spec, log)
    result.update(job_seconds=time.perf_counter() - t0, versions=versions(), gpu=spec["gpu"])
    write_json(Path(spec["result_path"]), round_sig(result))
    return 0


# ---------------------------------------------------------------------------------------------
# the plan of jobs and the pool (driver side)
# ---------------------------------------------------------------------------------------------
def plan_jobs(args, settings: dict, work: Path) -> list[dict]:
    """The jobs, in the order a free GPU takes the first whose needs are done: the checkpoint, the four tasks (they
    wait for it), the rate check (it runs on the other GPUs meanwhile)."""
    per_step = settings["batch_size"] * settings["block_size"]
    lr_steps = max(1, math.ceil(args.lr_tokens / per_step))
    ckpt = str(work / "checkpoint")
    jobs = [dict(name="checkpoint", kind="pretrain", pretrain_args=AR, learning_rate=1e-3, steps=args.ckpt_steps,
                 save_to=ckpt, needs=[])]
    for lr in args.lrs:
        jobs.append(dict(name=f"lr_check__dar-t2-1s__lr{lr:g}", kind="pretrain", pretrain_args=DAR_ONE_STREAM,
                         learning_rate=lr, steps=lr_steps, needs=[]))
    jobs.append(dict(name="lr_check__dar-t2__lr0.001", kind="pretrain", pretrain_args=DAR_TWO_STREAM,
                     learning_rate=1e-3, steps=lr_steps, needs=[]))
    jobs[1:] = sorted(jobs[1:], key=lambda j: abs(math.log(j["learning_rate"] / 1e-3)))  # the likeliest rates first
    # a free GPU takes the first job whose needs are done: the tasks go as soon as the checkpoint exists
    tasks = [dict(name=f"finetune__{task}", kind="finetune", task=task, checkpoint=ckpt, needs=["checkpoint"])
             for task in TASKS]
    return jobs[:1] + tasks + jobs[1:]


def _tail(path: Path, lines: int = 20) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []


def run_pool(jobs: list[dict], args, settings, prep, work: Path, report: dict, report_path: Path) -> None:
    deadline = args.t0 + args.minutes * 60
    threads = max(1, (os.cpu_count() or 1) // max(1, len(args.gpus_or_slots)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(HERE)] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    pending, running, done = list(jobs), {}, {}
    free = list(args.gpus_or_slots)
    while pending or running:
        for job in list(pending):
            # no job starts in the last minute: it could not finish
            if free and all(done.get(n) == 0 for n in job["needs"]) and time.time() < deadline - 60:
                gpu = free.pop(0)
                pending.remove(job)
                folder = work / job["name"]
                folder.mkdir(parents=True, exist_ok=True)
                spec = dict(job, gpu=gpu, settings=settings, prep=prep, seed=0, device=args.device, threads=threads,
                            cell_dir=str(folder), result_path=str(folder / "result.json"),
                            checkpoint_steps=[job.get("steps", 1)], warmup_fraction=WARMUP_FRACTION,
                            deadline_unix=deadline - args.exit_margin_s)
                (folder / "spec.json").write_text(json.dumps(spec, indent=1))
                job_env = dict(env) if gpu == "cpu" else dict(env, CUDA_VISIBLE_DEVICES=str(gpu))
                log = open(folder / "log.txt", "w")
                proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "job", str(folder / "spec.json")],
                                        stdout=log, stderr=subprocess.STDOUT, env=job_env)
                running[job["name"]] = (proc, gpu, time.time())
                print(f"[timing] {utc_now()} start {job['name']} on {gpu}", flush=True)
        # a job whose needs failed never starts
        for job in list(pending):
            if any(n in done and done[n] != 0 for n in job["needs"]):
                pending.remove(job)
                report["jobs"][job["name"]] = {"state": "not started: a job it needs failed", "needs": job["needs"]}
        time.sleep(args.poll_s)
        for name, (proc, gpu, started) in list(running.items()):
            if proc.poll() is None and time.time() > deadline:
                proc.kill()
                proc.wait()
            if proc.poll() is None:
                continue
            done[name] = proc.returncode
            del running[name]
            free.append(gpu)
            folder = work / name
            result_file = folder / "result.json"
            entry = {"exit_code": proc.returncode, "gpu": gpu, "wall_seconds": round(time.time() - started, 1)}
            if proc.returncode == 0 and result_file.is_file():
                entry.update(state="finished", result=json.loads(result_file.read_text()))
            else:
                entry.update(state="failed or killed at the deadline", log_tail=_tail(folder / "log.txt"))
            report["jobs"][name] = entry
            print(f"[timing] {utc_now()} {name}: {entry['state']} ({entry['wall_seconds']} s)", flush=True)
            report["minutes"] = round((time.time() - args.t0) / 60, 2)
            write_json(report_path, summarise(report))
        if not running and (time.time() > deadline - 60 or not pending):
            for job in pending:
                report["jobs"][job["name"]] = {"state": "not started before the deadline"}
            break


def summarise(report: dict) -> dict:
    """The numbers the protocol's budget needs, from the finished jobs."""
    jobs = report["jobs"]
    ft = {n.split("__", 1)[1]: j["result"] for n, j in jobs.items() if n.startswith("finetune__") and "result" in j}
    lr = {n: j["result"] for n, j in jobs.items() if n.startswith("lr_check__") and "result" in j}
    out = dict(report)
    out["finetune_seconds_per_task"] = {t: r["seconds"] for t, r in ft.items()}
    if len(ft) == len(TASKS):
        out["finetune_seconds_per_cell_one_gpu_alone"] = round(sum(r["seconds"] for r in ft.values()), 1)
    one = {r["learning_rate"]: r["heldout_loss"] for n, r in lr.items() if "dar-t2-1s" in n}
    out["lr_check_heldout_loss_dar_t2_1s"] = {f"{k:g}": v for k, v in sorted(one.items())}
    if one:
        out["lr_check_best_dar_t2_1s"] = min(one, key=lambda k: (one[k], k))
    out["lr_check_tokens_per_second"] = {n: r["tokens_per_second"] for n, r in lr.items()}
    return out


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
TINY = dict(preset="tiny", vocab_size=1024, val_blocks=8, eval_batch_size=64, ppl_passages=6, ppl_passage_chars=300,
            max_seq_length=64, ft_train=48, ft_epochs=1.0, ft_batch_size=16, ft_lrs=[1e-3], block_size=64,
            batch_size=8, ckpt_steps=4, lr_tokens=4 * 8 * 64, lrs=[1e-3, 2e-3])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "device_out"), help="finetune_timing.json goes here")
    p.add_argument("--work_dir", default="outputs/finetune_timing")
    p.add_argument("--corpus_dir", default=".devdata/c1/gutenberg")
    p.add_argument("--data_root", default=".devdata")
    p.add_argument("--bbc_dir", default=None)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch_size", type=int, default=64, help="pretraining batch (the curves protocol's)")
    p.add_argument("--ckpt_steps", type=int, default=300, help="the checkpoint that is fine-tuned: this many ar steps")
    p.add_argument("--lr_tokens", type=int, default=SWEEP_TOKENS, help="pretraining tokens of each rate-check run")
    p.add_argument("--lrs", type=float, nargs="+", default=SWEEP_LRS, help="dar one-stream's rates to check")
    p.add_argument("--minutes", type=float, default=6.3, help="the deadline: jobs still running are killed")
    p.add_argument("--exit_margin_s", type=float, default=10.0)
    p.add_argument("--poll_s", type=float, default=2.0)
    p.add_argument("--device", default=None, choices=("cpu", "cuda"))
    p.add_argument("--tiny", action="store_true", help="CPU dry run on synthetic data with tiny sizes")
    for key, value in {**DEFAULTS, **LIST_DEFAULTS}.items():
        if key in ("block_size",):
            p.add_argument(f"--{key}", type=int, default=value)
        elif isinstance(value, list):
            p.add_argument(f"--{key}", nargs="+", default=value, type=None if key == "ft_modes" else float)
        else:
            p.add_argument(f"--{key}", type=float if isinstance(value, float) else int, default=value)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        return run_job(argv[1])
    args = _parser().parse_args(argv)
    args.t0 = time.time()
    from study_common import git_commit, machine, settings_for, versions
    from study_data import corpus_sha256, prepare, write_synthetic_data

    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
        corpus, data, bbc = write_synthetic_data(Path(args.work_dir) / "synthetic")
        args.corpus_dir, args.data_root, args.bbc_dir = str(corpus), str(data), str(bbc)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    from study_grid import visible_gpus

    args.gpus_or_slots = visible_gpus(args.device) if args.device == "cuda" else ["cpu"]
    args.sweep_tokens = args.lr_tokens
    args.tokens = args.ckpt_steps * args.batch_size * args.block_size
    args.ft_modes, args.lora_lrs = ["full"], []
    settings = settings_for(args, args.preset, "cell")
    work = Path(args.work_dir)
    prep = prepare(settings, args.corpus_dir, args.data_root, work, args.bbc_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "finetune_timing.json"
    report = {"what": "issue 42's timing run: fine-tuning wall time per task (one job per GPU) and dar one-stream's "
                      "learning-rate check (held-out loss on the validation blocks)",
              "started_utc": utc_now(), "code_commit": git_commit(), "versions": versions(), "machine": machine(),
              "settings": settings, "prep": {k: prep[k] for k in ("data_id", "tokenizer_sha256", "train_tokens",
                                                                  "num_train_blocks", "num_val_blocks", "seconds")},
              "training_slice_sha256": corpus_sha256(args.corpus_dir),
              "lr_check": {"tokens": args.lr_tokens, "lrs": args.lrs, "warmup_fraction": WARMUP_FRACTION,
                           "schedule": "cosine over the run", "reference": "dar-t2 (two streams) at 1e-3"},
              "checkpoint_steps": args.ckpt_steps, "slots": args.gpus_or_slots, "jobs": {}}
    write_json(report_path, report)
    run_pool(plan_jobs(args, settings, work), args, settings, prep, work, report, report_path)
    report["finished_utc"], report["minutes"] = utc_now(), round((time.time() - args.t0) / 60, 2)
    final = summarise(report)
    write_json(report_path, final)
    print(json.dumps({k: final.get(k) for k in ("finetune_seconds_per_task", "finetune_seconds_per_cell_one_gpu_alone",
                                                "lr_check_heldout_loss_dar_t2_1s", "lr_check_best_dar_t2_1s",
                                                "lr_check_tokens_per_second", "minutes")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
