"""The study's driver: the learning-rate sweep and the grid, spread over every visible GPU, resumable.

Each job (a grid cell ``<preset>__<objective>__seed<s>`` or a sweep run ``sweep__<preset>__<objective>__lr<lr>``)
runs in its own process (``study.py --_cell spec.json``) with ``CUDA_VISIBLE_DEVICES`` set to one GPU;
``--cells_per_gpu`` processes share each GPU. Order: the sweep by objective and rate; the grid seed-major (whatever
part finishes holds whole seeds of every objective). A job whose JSON exists in ``--results_dir`` is not run again,
so a call cut off is resumed by running the same command again. ``--max_minutes``: no job starts unless it can end
before the limit (by the longest job so far, or ``--cell_minutes``); jobs still running at the limit are killed and
recorded as ``...__failed__<run_label>.json`` (with what they measured before).

Learning rates: ``--sweep`` pretrains one seed of every objective at each rate of ``--sweep_lrs`` for
``--sweep_tokens`` and records the validation objective loss. The grid then takes, per objective, the rate with
the lowest validation loss among the sweep runs (same preset, same prepared data) that did not diverge; without
sweep files it refuses to start unless ``--learning_rate`` is given.

On a cluster, one job per cell (the data are prepared once, then every job reads the cache in ``--work_dir``,
which must be a shared folder)::

    python study/study.py --prepare_only --work_dir /shared/study_work
    # the sweep, one job per run (keys: python study/study.py --sweep --list_cells)
    python study/study.py --sweep --only_cell sweep__small__ar__lr0.001 --work_dir /shared/study_work \\
        --results_dir /shared/study_results --run_label job-$JOB_ID
    # then the grid, one job per cell (keys: python study/study.py --list_cells)
    python study/study.py --only_cell small__ar__seed0 --work_dir /shared/study_work \\
        --results_dir /shared/study_results --run_label job-$JOB_ID
    # when all are done
    python study/study.py --report --results_dir /shared/study_results --output RESULTS.md
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from study_common import (
    PREP_RECORDED,
    _hash,
    cell_key,
    git_commit,
    lr_tag,
    machine,
    parse_key,
    round_sig,
    sanitize,
    settings_for,
    sweep_key,
    utc_now,
    write_bundle,
    write_json,
)

STUDY_PY = Path(__file__).resolve().parent / "study.py"


# ---------------------------------------------------------------------------------------------
# which jobs, in which order, on which GPU (pure functions)
# ---------------------------------------------------------------------------------------------
def grid_cells(presets, objectives, seeds) -> list[tuple[str, str, int]]:
    """Seed-major order within a preset: whatever part of the grid finishes holds whole seeds of every objective
    (paired comparisons need the same seed on both sides); the first preset is finished before the next."""
    return [(p, o, s) for p in presets for s in seeds for o in objectives]


def sweep_runs(presets, objectives, lrs) -> list[tuple[str, str, float]]:
    return [(p, o, float(lr)) for p in presets for o in objectives for lr in lrs]


def assign_gpus(keys: list[str], gpus: list, cells_per_gpu: int) -> dict[str, object]:
    """The first wave of jobs: ``keys`` (in order) over ``gpus``, round robin, at most ``cells_per_gpu`` each; the
    jobs that do not fit wait for a free slot (``next_gpu``)."""
    load = {g: 0 for g in gpus}
    out = {}
    for key in keys:
        gpu = next_gpu(load, cells_per_gpu)
        if gpu is None:
            break
        load[gpu] += 1
        out[key] = gpu
    return out


def next_gpu(load: dict, cells_per_gpu: int):
    """The GPU with a free slot and the fewest jobs (ties: the first), or None when every slot is taken."""
    free = [g for g in load if load[g] < cells_per_gpu]
    return min(free, key=lambda g: (load[g], list(load).index(g))) if free else None


def visible_gpus(device: str) -> list:
    """The GPU ids a child process may be given (``CUDA_VISIBLE_DEVICES`` of this process if set); ``["cpu"]`` on
    the CPU (one group of slots, no variable set)."""
    if device != "cuda":
        return ["cpu"]
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    if not ids[:count]:
        raise SystemExit("study: --device cuda but no GPU is visible")
    return ids[:count]


# ---------------------------------------------------------------------------------------------
# results already there
# ---------------------------------------------------------------------------------------------
def find_done(results_dir: Path, redo_partial: bool = False) -> dict[str, dict]:
    """Cells finished in an earlier call: status ok, or partial (some fine-tuning skipped for time) unless
    ``redo_partial``."""
    done = {}
    for path in sorted(Path(results_dir).glob("*__seed*.json")):
        if "__failed__" in path.name:
            continue
        data = json.loads(path.read_text())
        if data.get("status") == "ok" or (data.get("status") == "partial" and not redo_partial):
            done[data["key"]] = data
    return done


def find_sweeps(results_dir: Path, preset: str | None = None, objective: str | None = None) -> list[dict]:
    """Finished sweep runs (``sweep__*.json``, status ok) in ``results_dir``, with their file names."""
    out = []
    for path in sorted(Path(results_dir).glob("sweep__*.json")):
        if "__failed__" in path.name:
            continue
        data = json.loads(path.read_text())
        if data.get("status") != "ok":
            continue
        if (preset and data["preset"] != preset) or (objective and data["objective"] != objective):
            continue
        out.append(dict(data, file=path.name))
    return out


def divergence(runs: list[dict]) -> dict[str, list[str]]:
    """Why each sweep run (of one objective) diverged, by key: NaN/inf losses, a final training loss above the first
    logged one, or above 1.5x the final training loss of the run with the lowest validation loss."""
    reasons = {}
    finite = {}
    for r in runs:
        losses = r["pretrain"]["logged_losses"]
        val = r["pretrain"].get("validation_loss")
        why = []
        if not losses or any(v is None or not math.isfinite(v) for v in losses) or val is None or not math.isfinite(val):
            why.append("NaN or inf loss")
        elif len(losses) > 1 and losses[-1] > losses[0]:
            why.append(f"final training loss {losses[-1]:.4g} above the first logged {losses[0]:.4g}")
        if not why:
            finite[r["key"]] = r
        reasons[r["key"]] = why
    if finite:
        best = min(finite.values(), key=lambda r: r["pretrain"]["validation_loss"])
        ref = best["pretrain"]["logged_losses"][-1]
        for key, r in finite.items():
            final = r["pretrain"]["logged_losses"][-1]
            if final > 1.5 * ref:
                reasons[key].append(f"final training loss {final:.4g} above 1.5 x {ref:.4g} (the best rate's)")
    return reasons


def choose_learning_rate(results_dir: Path, preset: str, objective: str, data_id: str | None = None,
                         batch_size: int | None = None) -> tuple[float, dict]:
    """The rate of the sweep with the lowest validation objective loss among runs that did not diverge, and the
    record of where it came from (``pretrain.learning_rate_source``). ``data_id`` / ``batch_size``: only sweep runs
    on the same prepared data / batch count."""
    runs = [r for r in find_sweeps(results_dir, preset, objective)
            if (data_id is None or r["prep"].get("data_id") == data_id)
            and (batch_size is None or r["settings"]["batch_size"] == batch_size)]
    if not runs:
        raise LookupError(f"no sweep run of {preset}/{objective} in {results_dir}"
                          + (f" on the same data (data_id {data_id})" if data_id else ""))
    reasons = divergence(runs)
    ok = [r for r in runs if not reasons[r["key"]]]
    if not ok:
        raise LookupError(f"every sweep run of {preset}/{objective} in {results_dir} diverged: {reasons}")
    best = min(ok, key=lambda r: (r["pretrain"]["validation_loss"], r["learning_rate"]))
    source = {
        "method": "sweep: lowest validation objective loss among runs that did not diverge",
        "sweep_tokens": best["settings"]["tokens"],
        "runs": [{"file": r["file"], "learning_rate": r["learning_rate"],
                  "validation_loss": r["pretrain"]["validation_loss"],
                  "final_train_loss": (r["pretrain"]["logged_losses"] or [None])[-1],
                  "diverged": bool(reasons[r["key"]]), "diverged_reasons": reasons[r["key"]]}
                 for r in sorted(runs, key=lambda r: r["learning_rate"])],
    }
    return float(best["learning_rate"]), round_sig(source)


def mark_divergence(results_dir: Path, copy_to: Path | None = None) -> None:
    """Rewrite every sweep file's ``diverged`` flag with the rule over all rates of its objective."""
    groups = {}
    for r in find_sweeps(results_dir):
        groups.setdefault((r["preset"], r["objective"], r["prep"].get("data_id")), []).append(r)
    for runs in groups.values():
        reasons = divergence(runs)
        for r in runs:
            path = Path(results_dir) / r["file"]
            data = json.loads(path.read_text())
            data["diverged"], data["diverged_reasons"] = bool(reasons[r["key"]]), reasons[r["key"]]
            write_json(path, data, copy_to)


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def plan_jobs(args) -> list[dict]:
    """The jobs this call asks for, in order: ``--only_cell``/``--cells`` keys, else the sweep or the grid."""
    if args.cells:
        jobs = []
        for key in args.cells:
            k = parse_key(key)
            kind = k["kind"]
            jobs.append({"kind": kind, "key": key, "preset": k["preset"], "objective": k["objective"],
                         "seed": k["seed"] if kind == "cell" else args.sweep_seed,
                         "learning_rate": k.get("learning_rate")})
        return jobs
    if args.sweep:
        return [{"kind": "sweep", "key": sweep_key(p, o, lr), "preset": p, "objective": o, "seed": args.sweep_seed,
                 "learning_rate": lr} for p, o, lr in sweep_runs(args.presets, args.objectives, args.sweep_lrs)]
    return [{"kind": "cell", "key": cell_key(p, o, s), "preset": p, "objective": o, "seed": s, "learning_rate": None}
            for p, o, s in grid_cells(args.presets, args.objectives, args.seeds)]


def _done_sweeps(results_dir: Path) -> set[str]:
    return {r["key"] for r in find_sweeps(results_dir)}


def refuse_other_settings(results_dir: Path, done_cell: dict, job: dict) -> None:
    if done_cell["settings_id"] != _hash(job["settings"]):
        raise ValueError(
            f"{results_dir} already holds {job['key']} run with other settings ({done_cell['settings']}) "
            f"than now ({job['settings']}); use another --results_dir, or the same size flags as before")


def check_done_cells(args) -> None:
    """Refuse, before any work, a grid whose finished cells in ``--results_dir`` ran with other settings."""
    results_dir = Path(args.results_dir)
    done = find_done(results_dir, args.redo_partial) if results_dir.is_dir() else {}
    for job in plan_jobs(args):
        if job["kind"] == "cell" and job["key"] in done:
            refuse_other_settings(results_dir, done[job["key"]], dict(job, settings=settings_for(args, job["preset"], "cell")))


def run(args, argv, prepare) -> int:
    """Run the jobs of ``plan_jobs(args)`` not yet done; ``prepare(settings)`` returns the prepared data."""
    t0 = time.perf_counter()
    results_dir = Path(args.results_dir)
    copy_to = Path(args.copy_to) if args.copy_to else None
    work_dir = Path(args.work_dir)
    label = args.run_label
    command = sanitize(" ".join(shlex.quote(a) for a in ["python", "study/study.py", *argv]))
    deadline = t0 + args.max_minutes * 60
    done = find_done(results_dir, args.redo_partial) if results_dir.is_dir() else {}
    done_sweeps = _done_sweeps(results_dir) if results_dir.is_dir() else set()

    todo = []
    for job in plan_jobs(args):
        job["settings"] = settings_for(args, job["preset"], job["kind"])
        if job["kind"] == "sweep":
            if job["key"] not in done_sweeps:
                todo.append(job)
            continue
        if job["key"] in done:
            refuse_other_settings(results_dir, done[job["key"]], job)
            continue
        todo.append(job)
    # no learning rate, no grid: checked before any data is prepared
    if args.learning_rate is None:
        missing = sorted({f"{j['preset']}/{j['objective']}" for j in todo if j["kind"] == "cell"
                          and not find_sweeps(results_dir, j["preset"], j["objective"])}) if results_dir.is_dir() else \
            sorted({f"{j['preset']}/{j['objective']}" for j in todo if j["kind"] == "cell"})
        if missing:
            raise SystemExit(f"study: no learning-rate sweep in {results_dir} for {', '.join(missing)}: run "
                             "`study.py --sweep` first, or pass --learning_rate")
    gpus = visible_gpus(args.device)
    slots = len(gpus) * args.cells_per_gpu
    threads = args.threads_per_cell or max(1, (os.cpu_count() or 1) // slots)
    print(f"[study] run {label}: {len(todo)} job(s) to run ({len(done)} cell(s), {len(done_sweeps)} sweep run(s) "
          f"already in {results_dir}); {len(gpus)} GPU(s) x {args.cells_per_gpu}, {threads} thread(s) each, "
          f"limit {args.max_minutes} min", flush=True)
    if not todo:
        return 0
    commit = args.git_commit or git_commit()
    summary_path = results_dir / f"run__{label}.json"
    summary = {"run_label": label, "command": command, "git_commit": commit, "started_utc": utc_now(),
               "max_minutes": args.max_minutes, "cells_per_gpu": args.cells_per_gpu, "threads_per_cell": threads,
               "machine": machine() if args.device == "cuda" else {"gpu_count": 0, "gpu_names": [],
                                                                     "cpu_count": os.cpu_count()},
               "kinds": sorted({j["kind"] for j in todo}), "cells_done_before": sorted(done),
               "cells_ok": [], "cells_failed": [], "cells_not_started": [], "status": "running"}
    written = []  # every JSON this call wrote: also bundled in one file, in case a device returns only a few files

    def save_summary():
        summary["wall_seconds"] = time.perf_counter() - t0
        summary["minutes"] = round(summary["wall_seconds"] / 60, 2)
        write_json(summary_path, summary, copy_to)
        if summary_path not in written:
            written.append(summary_path)
        if copy_to is not None:
            write_bundle(copy_to / f"bundle__{label}.json.gz", written)

    preps = {}
    for job in todo:
        pkey = (job["preset"], job["kind"])
        if pkey not in preps:
            preps[pkey] = prepare(job["settings"])
    summary["prep_seconds"] = time.perf_counter() - t0
    if args.prepare_only:
        return 0
    # the learning rate of each grid cell
    for job in todo:
        if job["kind"] == "sweep":
            job["learning_rate_source"] = {"method": "sweep run", "sweep_lrs": list(args.sweep_lrs)}
        elif args.learning_rate is not None:
            job["learning_rate"] = args.learning_rate
            job["learning_rate_source"] = {"method": "--learning_rate"}
        else:
            try:
                job["learning_rate"], job["learning_rate_source"] = choose_learning_rate(
                    results_dir, job["preset"], job["objective"], preps[(job["preset"], "cell")]["data_id"],
                    job["settings"]["batch_size"])
            except LookupError as err:
                raise SystemExit(f"study: {err}: run `study.py --sweep` on the same data, or pass --learning_rate")
    summary["learning_rates"] = {f"{j['preset']}/{j['objective']}": j["learning_rate"] for j in todo}
    save_summary()

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    pending, running, durations = list(todo), {}, []
    load = {g: 0 for g in gpus}
    device_name = ", ".join(summary["machine"]["gpu_names"]) or "cpu"
    estimate = args.cell_minutes * 60

    def finish(key, job, status, reason=None):
        wall = time.perf_counter() - job["t"]
        record = {"key": key, "kind": job["kind"], "preset": job["preset"], "objective": job["objective"],
                  "seed": job["seed"], "learning_rate": job["learning_rate"],
                  "settings": job["settings"], "settings_id": _hash(job["settings"]), "run_label": label,
                  "command": command, "cell_command": job["cmd"], "git_commit": commit,
                  "started_utc": job["utc"], "finished_utc": utc_now(), "wall_seconds": wall,
                  "prep": {k: job["prep"][k] for k in PREP_RECORDED},
                  "threads": threads, "cells_per_gpu": args.cells_per_gpu, "gpu": job["gpu"], "device": device_name}
        log_tail = sanitize(Path(job["log"]).read_text(errors="replace")[-4000:]) if Path(job["log"]).is_file() else ""
        if copy_to is not None and args.copy_logs and Path(job["log"]).is_file():
            (copy_to / "logs").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(job["log"], copy_to / "logs" / f"{key}__{label}.log")
        measured = json.loads(Path(job["result"]).read_text()) if Path(job["result"]).is_file() else {}
        if status == "ok":
            record.update(measured)
            skipped = measured.get("finetune", {}).get("skipped")
            record["status"] = "partial" if skipped else "ok"
            if job["kind"] == "sweep":
                record["validation_loss"] = measured["pretrain"]["validation_loss"]
                reasons = divergence([record])[key]
                record["diverged"], record["diverged_reasons"] = bool(reasons), reasons
            path = results_dir / f"{key}.json"
            summary["cells_ok"].append(key)
            durations.append(wall)
        else:
            # what the job measured before it stopped is kept, but a failed cell never enters the tables
            record.update(measured, status=status, reason=reason, log_tail=log_tail,
                          measured_phases=[k for k in ("pretrain", "perplexity", "probe", "finetune") if k in measured])
            path = results_dir / f"{key}__failed__{label}.json"
            summary["cells_failed"].append(key)
        write_json(path, record, copy_to)
        written.append(path)
        print(f"[study] {key}: {record['status']} after {wall / 60:.1f} min" + (f" ({reason})" if reason else ""),
              flush=True)
        if status != "ok":
            print("\n".join("    " + line for line in log_tail.splitlines()[-15:]), flush=True)
        save_summary()

    def start(job, gpu):
        key = job["key"]
        cell_dir = work_dir / "cells" / f"{key}__{label}"
        shutil.rmtree(cell_dir, ignore_errors=True)
        cell_dir.mkdir(parents=True)
        job["prep"] = preps[(job["preset"], job["kind"])]
        spec = {"key": key, "kind": job["kind"], "preset": job["preset"], "objective": job["objective"],
                "seed": job["seed"], "settings": job["settings"], "prep": job["prep"], "device": args.device,
                "learning_rate": job["learning_rate"], "learning_rate_source": job["learning_rate_source"],
                "threads": threads, "cell_dir": str(cell_dir), "result_path": str(cell_dir / "result.json"),
                "deadline_unix": time.time() + (deadline - time.perf_counter())}
        (cell_dir / "spec.json").write_text(json.dumps(spec, indent=1))
        cmd = [sys.executable, str(STUDY_PY), "--_cell", str(cell_dir / "spec.json")]
        shown = ["python", "study/study.py", "--_cell", str(cell_dir / "spec.json")]
        log_path = cell_dir / "log.txt"
        job_env = dict(env, HF_DATASETS_CACHE=str(cell_dir / "hf_datasets_cache"))  # no two processes share a cache
        if gpu != "cpu":
            job_env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=job_env)
        job.update(proc=proc, t=time.perf_counter(), utc=utc_now(), log=str(log_path), result=spec["result_path"],
                   cmd=sanitize(" ".join(shlex.quote(c) for c in shown)), gpu=gpu)
        load[gpu] += 1
        running[key] = job
        print(f"[study] started {key}" + (f" on GPU {gpu}" if gpu != "cpu" else "")
              + f" (lr {job['learning_rate']:g})", flush=True)

    while pending or running:
        now = time.perf_counter()
        expected = max(durations) if durations else estimate
        while pending and now + expected <= deadline:
            gpu = next_gpu(load, args.cells_per_gpu)
            if gpu is None:
                break
            start(pending.pop(0), gpu)
        if not running and pending:  # nothing runs and nothing more may start: the time is up
            break
        time.sleep(0.5)
        for key, job in list(running.items()):
            code = job["proc"].poll()
            if code is not None:
                del running[key]
                load[job["gpu"]] -= 1
                ok = code == 0 and Path(job["result"]).is_file() and json.loads(Path(job["result"]).read_text())["complete"]
                finish(key, job, "ok" if ok else "failed", None if ok else f"exit code {code}")
            elif time.perf_counter() > deadline:
                job["proc"].kill()
                job["proc"].wait()
                del running[key]
                load[job["gpu"]] -= 1
                finish(key, job, "timeout", f"killed at the --max_minutes limit ({args.max_minutes} min)")
    if any(j["kind"] == "sweep" for j in todo):
        mark_divergence(results_dir, copy_to)
    summary["cells_not_started"] = [j["key"] for j in pending]
    summary["status"] = "complete"
    summary["finished_utc"] = utc_now()
    summary["cells_ok_count"], summary["cells_failed_count"] = len(summary["cells_ok"]), len(summary["cells_failed"])
    save_summary()
    print(f"[study] run {label}: {len(summary['cells_ok'])} ok, {len(summary['cells_failed'])} failed, "
          f"{len(pending)} not started (time) in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    return 0 if not summary["cells_failed"] else 1


__all__ = ["grid_cells", "sweep_runs", "assign_gpus", "next_gpu", "visible_gpus", "find_done", "find_sweeps",
           "divergence", "choose_learning_rate", "mark_divergence", "plan_jobs", "run", "lr_tag"]
