"""The study's learning curves (issue 32): each claim against tokens seen, under a protocol fixed before the grid.

    # on the development machine, right before a part's device commands (refuses a dirty tree)
    python study/study_curves.py preflight
    # on the GPU machine, once per device command (resumes the part's unfinished cells from the machine's disk)
    python study/study_curves.py run --part 1 --command_label p1c1 --minutes 9 --bundle_dir $OUT
    # back here: the report from the returned bundles
    python study/study_curves_report.py --bundles device_out/curves__*.json.gz --output docs/results/study32/RESULTS.md

The protocol is ``study/study_protocol_curves.json``; ``run`` refuses to start without it, without the
commit stamp the pre-flight wrote (``.devdata/curves/code_commit.json``, carried with the data) or with a stamp
that says dirty or names another protocol. Every record holds the stamp's commit and the protocol's SHA-256.

A part is a set of complete cells (objective x seed). One ``run`` starts every unfinished cell of the part
(``cells_per_gpu`` per GPU, GPU by a Latin square), each worker (``study_curves_cell.py``) pretrains to the next
checkpoint, evaluates it, and so on until the deadline, when it saves a resumable checkpoint and exits; the next
``run`` resumes from there. Each evaluation is one record file written atomically when it finishes; the driver
rewrites the bundle (every record of the part so far, one gzipped JSON) whenever a record appears.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from study_common import REPO, utc_now, write_json

HERE = Path(__file__).resolve().parent
PROTOCOL_PATH = HERE / "study_protocol_curves.json"
STAMP_PATH = REPO / ".devdata" / "curves" / "code_commit.json"
CELL_PY = HERE / "study_curves_cell.py"


# ---------------------------------------------------------------------------------------------
# the protocol and the commit stamp
# ---------------------------------------------------------------------------------------------
def protocol_sha256(path: Path = PROTOCOL_PATH) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_protocol(path: Path = PROTOCOL_PATH) -> dict:
    if not Path(path).is_file():
        raise SystemExit(f"study curves: no protocol at {path}: the grid does not start without its protocol")
    protocol = json.loads(Path(path).read_text())
    protocol["sha256"] = protocol_sha256(path)
    return protocol


def git_state(repo: Path = REPO) -> tuple[str, str]:
    """``(HEAD commit, git status --porcelain)`` of the checkout (untracked files count: they would travel)."""
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                            check=True)
    return head.stdout.strip(), status.stdout.strip()


def tracked_blobs(repo: Path = REPO) -> dict[str, str]:
    """Every tracked file of the commit and its git blob SHA-1 (``git ls-files -s``; submodules left out)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-s", "-z"], capture_output=True, check=True).stdout
    blobs = {}
    for entry in filter(None, out.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        mode, sha, _ = meta.split()
        if mode != b"160000":
            blobs[path.decode()] = sha.decode()
    return blobs


def blob_sha1(path: Path) -> str:
    """The git blob SHA-1 of a file as it is on disk (a symbolic link: of its target's name), no git needed."""
    data = os.readlink(path).encode() if Path(path).is_symlink() else Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def preflight(stamp_path: Path = STAMP_PATH, repo: Path = REPO, protocol_path: Path = PROTOCOL_PATH) -> dict:
    """On the development machine: refuse a dirty tree, else write the commit stamp the device side records, with
    the blob SHA-1 of every tracked file (the device checks its tree against them before the first cell)."""
    commit, status = git_state(repo)
    if status:
        raise SystemExit("study curves: the tree is dirty; commit first (git status --porcelain):\n" + status)
    stamp = {"commit": commit, "dirty": False, "protocol_sha256": protocol_sha256(protocol_path),
             "written_utc": utc_now(), "how": "git rev-parse HEAD on the development machine, status --porcelain empty",
             "tree": tracked_blobs(repo)}
    write_json(stamp_path, stamp)
    return stamp


def verify_tree(stamp: dict, root: Path = REPO, required: bool = False) -> int:
    """On the device, before the first cell: every file of the stamped commit is here with the same content, else
    refuse (the device has no git: the blob SHA-1s of the stamp are the commit's content). Returns the file count.
    ``required``: a stamp without the list is refused too (the C1 protocol: ``record.tree_check``)."""
    tree = stamp.get("tree")
    if tree is None:
        if required:
            raise SystemExit("study curves: the commit stamp lists no files (an older pre-flight): run "
                             "`python study/study_curves.py preflight` again and carry .devdata")
        return 0
    wrong = [path for path, sha in sorted(tree.items())
             if not (Path(root) / path).exists() and not (Path(root) / path).is_symlink()
             or blob_sha1(Path(root) / path) != sha]
    if wrong:
        raise SystemExit(f"study curves: this tree is not commit {stamp['commit'][:12]}: {len(wrong)} file(s) differ "
                         f"or are missing ({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''}); merge and run "
                         "the pre-flight again")
    return len(tree)


def read_stamp(protocol: dict, stamp_path: Path = STAMP_PATH) -> dict:
    """On the device: the pre-flight's stamp, refused if missing, dirty or written for another protocol."""
    if not Path(stamp_path).is_file():
        raise SystemExit(f"study curves: no commit stamp {stamp_path}: run `python study/study_curves.py "
                         "preflight` on the development machine and carry .devdata")
    stamp = json.loads(Path(stamp_path).read_text())
    if stamp.get("dirty") is not False or not stamp.get("commit") or "dirty" in str(stamp.get("commit")):
        raise SystemExit(f"study curves: the commit stamp says the tree was dirty: {stamp}")
    if stamp.get("protocol_sha256") != protocol["sha256"]:
        raise SystemExit(f"study curves: the stamp was written for protocol {stamp.get('protocol_sha256')}, "
                         f"this tree's protocol is {protocol['sha256']}: run the pre-flight again")
    return stamp


# ---------------------------------------------------------------------------------------------
# cells, checkpoints and the balanced assignment (pure)
# ---------------------------------------------------------------------------------------------
def cell_key(objective: str, seed: int, preset: str = "small") -> str:
    return f"{preset}__{objective}__seed{seed}"


def part_cells(protocol: dict, part: str, with_optional: bool = False) -> list[tuple[str, int]]:
    """The part's cells, objective-major: [(objective, seed)] (``protocol["only"]``: the dry run's subset)."""
    spec = protocol["parts"][str(part)]
    blocks = [spec] + ([spec["optional"]] if with_optional and "optional" in spec else [])
    cells = [(o, s) for b in blocks for o in b["objectives"] for s in b["seeds"]]
    only = protocol.get("only") or {}
    return [(o, s) for o, s in cells if o in only.get("objectives", [o]) and s in only.get("seeds", [s])]


def latin_square(cells: list[tuple[str, int]], gpus: list) -> dict[tuple[str, int], object]:
    """(objective, seed) -> GPU: (objective's index + seed's index) mod G. With as many seeds as GPUs (or a
    multiple) every GPU runs every objective equally often, so a slow or cut GPU hurts no objective more."""
    objectives = list(dict.fromkeys(o for o, _ in cells))
    seeds = sorted({s for _, s in cells})
    return {(o, s): gpus[(objectives.index(o) + seeds.index(s)) % len(gpus)] for o, s in cells}


def checkpoint_steps(protocol: dict) -> list[int]:
    """The optimizer step of each checkpoint: ceil(tokens / (batch x block))."""
    per_step = protocol["batch_size"] * protocol["block_size"]
    return [-(-int(t) // per_step) for t in protocol["checkpoint_tokens"]]


def tokens_tag(tokens: int) -> str:
    return f"{tokens / 1e6:g}M"


def record_name(key: str, tokens: int) -> str:
    return f"{key}__{tokens_tag(tokens)}.json"


def finetune_name(key: str) -> str:
    return f"{key}__finetune.json"


def cell_record_names(key: str, protocol: dict, finetune: bool = True) -> list[str]:
    """The records a finished cell has: one per checkpoint, and its fine-tuning."""
    return [record_name(key, t) for t in protocol["checkpoint_tokens"]] + ([finetune_name(key)] if finetune else [])


def complete_runs(records: dict[str, dict], protocol: dict, finetune: bool = True) -> dict[str, dict[str, dict]]:
    """cell key -> {record name: record} of the cell's first complete run among ``records`` (name -> record): every
    record of the cell from one ``cell_run`` (a cell run again after a lost machine is a new run)."""
    runs: dict[tuple[str, str], dict[str, dict]] = {}
    for name, r in records.items():
        runs.setdefault((r.get("key"), r.get("cell_run")), {})[name] = r
    out = {}
    for (key, run), named in sorted(runs.items(), key=lambda kv: max(r.get("finished_unix", 0) for r in kv[1].values())):
        if key not in out and set(cell_record_names(key, protocol, finetune)) <= set(named):
            out[key] = named
    return out


def import_finished(bundles, records_dir: Path, protocol: dict, finetune: bool = True) -> list[str]:
    """Before a command on a new machine: the records of every cell that finished in an earlier bundle (one run,
    every record), so that it is never run again; a cell that did not finish there runs again from step 0."""
    imported = []
    for path in bundles or []:
        for key, named in complete_runs(read_bundle(Path(path))["records"], protocol, finetune).items():
            if all((Path(records_dir) / n).is_file() for n in named):
                continue
            for name, record in named.items():
                write_json(Path(records_dir) / name, record)
            imported.append(key)
    return sorted(set(imported))


def cell_finished(records_dir: Path, key: str, protocol: dict, finetune: bool) -> bool:
    names = [record_name(key, t) for t in protocol["checkpoint_tokens"]] + ([finetune_name(key)] if finetune else [])
    return all((Path(records_dir) / n).is_file() for n in names)


# ---------------------------------------------------------------------------------------------
# the bundle: every record of the part, one file, rewritten atomically
# ---------------------------------------------------------------------------------------------
def write_bundle(records_dir: Path, path: Path, extra: dict | None = None) -> int:
    records = {p.name: json.loads(p.read_text()) for p in sorted(Path(records_dir).glob("*.json"))}
    payload = {"records": records, **(extra or {})}
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as handle:
        json.dump(payload, handle, sort_keys=True)
    tmp.replace(path)
    return len(records)


def unfinished_state(cell_dir: Path, command_label: str, tail_lines: int = 25) -> dict:
    """What an unfinished cell left on the machine's disk, for the bundle: the machine (and so the cell's folder)
    goes back after the part, so the bundle is the only place to read why a cell did not finish."""
    cell_dir = Path(cell_dir)
    state = {}
    partial = cell_dir / "finetune_partial.json"
    if partial.is_file():
        done = json.loads(partial.read_text())
        state["finetune_tasks_done"] = {task: round(d.get("seconds", 0.0), 1) for task, d in done.items()}
    log = cell_dir / f"log__{command_label}.txt"
    if log.is_file():
        state["log_tail"] = log.read_text(errors="replace").splitlines()[-tail_lines:]
    return state


def read_bundle(path: Path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return json.load(handle)


# ---------------------------------------------------------------------------------------------
# the driver (device side)
# ---------------------------------------------------------------------------------------------
def _settings(protocol: dict, args) -> dict:
    """The study's settings of a cell (study_common.settings_for) with the protocol's sizes."""
    from study_common import settings_for

    ns = argparse.Namespace(**{k: getattr(args, k) for k in vars(args)})
    ns.tokens, ns.batch_size = protocol["checkpoint_tokens"][-1], protocol["batch_size"]
    ns.block_size = protocol["block_size"]
    return settings_for(ns, args.preset, "cell")


def _spec(protocol, stamp, args, objective, seed, gpu, prep, settings, deadline_unix, threads) -> dict:
    key = cell_key(objective, seed, args.preset)
    cell_dir = Path(args.work_dir) / "cells" / key  # the same folder in every command: resume from its checkpoints
    entry = protocol["objectives"][objective]
    return {"key": key, "objective": objective, "seed": seed, "pretrain_args": entry["pretrain_args"],
            "learning_rate": entry["learning_rate"], "full_length": entry["full_length_protocol"],
            "checkpoint_tokens": protocol["checkpoint_tokens"], "checkpoint_steps": checkpoint_steps(protocol),
            "warmup_fraction": protocol["warmup_fraction"], "settings": settings, "prep": prep,
            "finetune": args.finetune, "code_commit": stamp["commit"], "protocol_sha256": protocol["sha256"],
            "command_label": args.command_label, "part": str(args.part), "gpu": gpu, "device": args.device,
            "threads": threads, "cell_dir": str(cell_dir), "records_dir": str(args.records_dir),
            "deadline_unix": deadline_unix, "eval_minutes_guess": args.eval_minutes_guess,
            "rate_processes": args.rate_processes,
            "steps_this_command": args.steps_this_command, "second_scorer": args.second_scorer,
            "perplexity": protocol.get("evaluation", {}).get("perplexity", True),
            "features": protocol_features(protocol)}


def protocol_features(protocol) -> str:
    """The token states probes and fine-tuning read (``evaluation.representation.features``); a protocol that names
    none ran before issue 42 and read ``content_last_layer``."""
    return protocol.get("evaluation", {}).get("representation", {}).get("features", "content_last_layer")


def _start(spec: dict, env: dict) -> subprocess.Popen:
    cell_dir = Path(spec["cell_dir"])
    cell_dir.mkdir(parents=True, exist_ok=True)
    spec_path = cell_dir / f"spec__{spec['command_label']}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    job_env = dict(env, HF_DATASETS_CACHE=str(cell_dir / "hf_datasets_cache"))
    if spec["gpu"] != "cpu":
        job_env["CUDA_VISIBLE_DEVICES"] = str(spec["gpu"])
    log = open(cell_dir / f"log__{spec['command_label']}.txt", "w")
    return subprocess.Popen([sys.executable, str(CELL_PY), str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                            env=job_env)


def run_part(args, protocol: dict) -> int:
    """One device command: every unfinished cell of the part until the deadline; the bundle after each record."""
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    stamp = read_stamp(protocol, Path(args.stamp))
    checked = verify_tree(stamp, REPO, required=protocol.get("record", {}).get("tree_check", False))
    records_dir = Path(args.records_dir)
    records_dir.mkdir(parents=True, exist_ok=True)
    imported = import_finished(args.finished_from, records_dir, protocol, args.finetune)
    cells = [c for c in part_cells(protocol, args.part, args.with_optional)
             if not cell_finished(records_dir, cell_key(*c, args.preset), protocol, args.finetune)]
    pending = [f"objectives.{o}.learning_rate" for o in dict.fromkeys(o for o, _ in cells)
               if not isinstance(protocol["objectives"][o]["learning_rate"], (int, float))]
    pending += [] if isinstance(args.cells_per_gpu, int) else ["cells_per_gpu"]
    if pending:
        raise SystemExit(f"study curves: the protocol is a draft, {', '.join(pending)} not filled (pending the timing "
                         "run): fill them and commit before any cell runs")
    gpus = _gpus(args.device)
    placement = latin_square(part_cells(protocol, args.part, args.with_optional), gpus)
    threads = max(1, (os.cpu_count() or 1) // max(1, len(gpus) * args.cells_per_gpu))
    bundle = Path(args.bundle_dir) / f"curves__part{args.part}__{args.command_label}.json.gz"
    Path(args.bundle_dir).mkdir(parents=True, exist_ok=True)
    summary = {"command_label": args.command_label, "part": str(args.part), "code_commit": stamp["commit"],
               "protocol_sha256": protocol["sha256"], "started_utc": utc_now(), "gpus": gpus,
               "cells_to_run": [cell_key(*c, args.preset) for c in cells], "minutes_limit": args.minutes,
               "tree_checked_files": checked, "imported_finished_cells": imported}
    print(f"[curves] part {args.part}, command {args.command_label}: {len(cells)} unfinished cell(s) on "
          f"{len(gpus)} GPU(s), commit {stamp['commit'][:12]}, protocol {protocol['sha256'][:12]}", flush=True)
    if not cells:
        write_bundle(records_dir, bundle, {"summary": dict(summary, minutes=0.0)})
        return 0
    settings = _settings(protocol, args)
    prep = _prepare(settings, args)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=_pythonpath())
    procs, pending = {}, list(cells)
    load = {g: 0 for g in gpus}
    seen, exits = -1, {}
    while pending or procs:
        for cell in list(pending):
            gpu = placement[cell]
            if load[gpu] < args.cells_per_gpu:
                pending.remove(cell)
                spec = _spec(protocol, stamp, args, *cell, gpu, prep, settings, deadline - args.exit_margin_s, threads)
                procs[cell] = (_start(spec, env), gpu)
                load[gpu] += 1
        time.sleep(args.poll_s)
        for cell, (proc, gpu) in list(procs.items()):
            if proc.poll() is None and time.time() > deadline:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                exits[cell_key(*cell, args.preset)] = proc.returncode
                del procs[cell]
                load[gpu] -= 1
        count = len(list(records_dir.glob("*.json")))
        if count != seen:
            seen = write_bundle(records_dir, bundle, {"summary": dict(summary, minutes=(time.time() - t0) / 60)})
        if time.time() > deadline and not procs:
            break
    summary.update(finished_utc=utc_now(), minutes=round((time.time() - t0) / 60, 2),
                   cells_unfinished=[cell_key(*c, args.preset) for c in part_cells(protocol, args.part, args.with_optional)
                                     if not cell_finished(records_dir, cell_key(*c, args.preset), protocol, args.finetune)])
    summary["cell_exit_codes"] = exits
    summary["unfinished_state"] = {key: unfinished_state(Path(args.work_dir) / "cells" / key, args.command_label)
                                   for key in summary["cells_unfinished"]}
    n = write_bundle(records_dir, bundle, {"summary": summary})
    print(f"[curves] {n} record(s) in {bundle.name}; unfinished: {summary['cells_unfinished'] or 'none'}; "
          f"{summary['minutes']} min", flush=True)
    return 0


def _pythonpath() -> str:
    parts = [str(REPO / "src"), str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(parts)


def _gpus(device: str) -> list:
    from study_grid import visible_gpus

    return visible_gpus(device)


def _prepare(settings: dict, args) -> dict:
    from study_data import prepare

    from study_data import corpus_sha256

    prep = prepare(settings, args.corpus_dir, args.data_root, Path(args.work_dir), args.bbc_dir, args.num_proc)
    if "heldout_documents" not in prep:
        raise SystemExit("study curves: the prepared data has no heldout_documents (an older cache): use a new --work_dir")
    return dict(prep, training_slice_sha256=corpus_sha256(args.corpus_dir))  # every record names its slice


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from study_common import DEFAULTS, LIST_DEFAULTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    pre = sub.add_parser("preflight", help="development machine: write the commit stamp (refuses a dirty tree)")
    pre.add_argument("--protocol", default=str(PROTOCOL_PATH))
    pre.add_argument("--stamp", default=str(STAMP_PATH))
    cells = sub.add_parser("cells", help="print the part's cells and their GPUs")
    run = sub.add_parser("run", help="device: one command of a part")
    for q in (cells, run):
        q.add_argument("--part", required=True, choices=("1", "2"))
        q.add_argument("--with_optional", action="store_true", help="also the part's optional cells (gvp-k8)")
        q.add_argument("--gpus", type=int, default=4, help="cells: the GPU count to show the assignment for")
    run.add_argument("--only_objectives", nargs="+", default=None, help="a subset of the part (the CPU dry run)")
    run.add_argument("--only_seeds", nargs="+", type=int, default=None, help="a subset of the part (the CPU dry run)")
    run.add_argument("--command_label", required=True, help="names this command (p1c1, p1c2, ...)")
    run.add_argument("--minutes", type=float, default=9.0, help="the command's deadline")
    run.add_argument("--exit_margin_s", type=float, default=25.0, help="workers stop this long before the deadline")
    run.add_argument("--bundle_dir", default=os.environ.get("OUT", "device_out"))
    run.add_argument("--records_dir", default="outputs/curves/records", help="on the machine's disk, kept between commands")
    run.add_argument("--work_dir", default="outputs/curves/work")
    run.add_argument("--protocol", default=str(PROTOCOL_PATH))
    run.add_argument("--stamp", default=str(STAMP_PATH))
    run.add_argument("--corpus_dir", default=".devdata/gutenberg")
    run.add_argument("--data_root", default=".devdata")
    run.add_argument("--bbc_dir", default=None)
    run.add_argument("--num_proc", type=int, default=None)
    run.add_argument("--preset", default=None, help="default: the protocol's (tiny: the CPU dry run)")
    run.add_argument("--tiny", action="store_true", help="CPU dry run: preset tiny, small evaluation sizes, "
                     "checkpoints from --tiny_tokens")
    run.add_argument("--tiny_tokens", type=int, nargs="+", default=None)
    run.add_argument("--cells_per_gpu", type=int, default=None)
    run.add_argument("--finetune", action=argparse.BooleanOptionalAction, default=True)
    run.add_argument("--rate_processes", type=int, default=1,
                     help="fine-tune this many rates of a task's grid at once, each in its own process (results are "
                          "unchanged: every rate is an independent seeded run); the device commands use 3")
    run.add_argument("--eval_minutes_guess", type=float, default=3.0, help="an evaluation's minutes before one ran")
    run.add_argument("--steps_this_command", type=int, default=None,
                     help="at most this many pretraining steps per cell in this command, then save and leave as at "
                          "the deadline (a stop that does not depend on the machine's speed: the CPU dry run)")
    run.add_argument("--second_scorer", choices=("lm_eval",), default=None,
                     help="also score each checkpoint's AR-protocol held-out passages with lm-evaluation-harness "
                          "(rolling log-likelihood) beside the package's ar_perplexity on the same windows; the "
                          "record's second_scorer says whether they agree within 0.3%%. Needs lm-eval 0.4.13: the "
                          "device machines have none; carry in .devdata/whl the wheels of lm_eval 0.4.13, "
                          "sacrebleu 2.6.0, portalocker 4.4.2, tabulate 0.10.0 and lxml 6.1.3 (cp312) "
                          "(study/study_curves_device_call.sh)")
    run.add_argument("--poll_s", type=float, default=2.0)
    run.add_argument("--finished_from", nargs="+", default=None,
                     help="bundles of earlier commands (another machine, lost since): their finished cells are "
                          "imported and never run again; the others run again from step 0 (the protocol's rule)")
    run.add_argument("--device", default=None, choices=("cpu", "cuda"))
    for key, value in {**DEFAULTS, **LIST_DEFAULTS}.items():
        kind = float if isinstance(value, float) else int
        if isinstance(value, list):
            run.add_argument(f"--{key}", nargs="+", default=value, type=None if key == "ft_modes" else float)
        else:
            run.add_argument(f"--{key}", type=kind, default=value)
    return p


TINY = dict(preset="tiny", vocab_size=1024, val_blocks=8, eval_batch_size=64, ppl_passages=6, ppl_passage_chars=300,
            max_seq_length=64, ft_train=48, ft_eval=None, ft_batch_size=16, ft_epochs=1.0, ft_lrs=[1e-3],
            probe_train=64, probe_eval=64)


def _apply_run_defaults(args, protocol: dict, given: set[str] = frozenset()) -> None:
    """The dry run's sizes (``TINY``), except those given on the command line (``given``)."""
    if args.tiny:
        for key, value in TINY.items():
            if key not in given:
                setattr(args, key, value)
    args.preset = args.preset or protocol["preset"]
    args.cells_per_gpu = args.cells_per_gpu or protocol["cells_per_gpu"]
    args.ft_modes = ["full"]
    args.lora_lrs = []
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_protocol(protocol: dict, tokens: list[int]) -> dict:
    """The CPU dry run's protocol: the same file's content with tiny batch, block and checkpoints."""
    return dict(protocol, batch_size=8, block_size=64, checkpoint_tokens=list(tokens))


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.what == "preflight":
        stamp = preflight(Path(args.stamp), REPO, Path(args.protocol))
        print(f"wrote {args.stamp}: commit {stamp['commit']}, protocol {stamp['protocol_sha256'][:12]}, "
              f"{len(stamp['tree'])} files")
        return 0
    protocol = load_protocol(Path(getattr(args, "protocol", PROTOCOL_PATH)))
    if args.what == "cells":
        placement = latin_square(part_cells(protocol, args.part, args.with_optional), list(range(args.gpus)))
        for (o, s), gpu in placement.items():
            print(f"{cell_key(o, s)}\tGPU {gpu}")
        return 0
    argv = sys.argv[1:] if argv is None else argv
    _apply_run_defaults(args, protocol, {a[2:].split("=")[0] for a in argv if a.startswith("--")})
    if args.second_scorer == "lm_eval" and importlib.util.find_spec("lm_eval") is None:
        raise SystemExit("study curves: --second_scorer lm_eval needs lm-eval 0.4.13 (pip install -e '.[lm_eval]'; "
                         "on a device machine carry its wheels, study/study_curves_device_call.sh lists them)")
    if args.tiny:  # the dry run reads the committed file (its SHA-256 recorded), then shrinks its sizes
        protocol = dict(tiny_protocol(protocol, args.tiny_tokens or [2 * 8 * 64, 4 * 8 * 64]), sha256=protocol["sha256"])
    if args.only_objectives or args.only_seeds:
        protocol["only"] = {k: v for k, v in (("objectives", args.only_objectives), ("seeds", args.only_seeds)) if v}
    return run_part(args, protocol)


if __name__ == "__main__":
    sys.exit(main())
