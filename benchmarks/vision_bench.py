"""Vision benchmark (issue 10): GVP target modes and segmentations vs the variable-mask MAE baseline.

ViT ``small`` (hidden 256, 6 layers, 4 heads) on Fashion-MNIST, 3 seeds, seven configurations:

- GVP (K = 20 groups) with target mode p2p, p2d, d2d, each with mixed and with fixed segmentation;
- the variable-mask MAE baseline (``vmlm``: mask ratio per image from U[0.5, 0.75]), p2p.

Each run is one ``hf-lookaround vision`` command (``python -m hf_lookaround.cli vision``): pretrain, save the
checkpoint and its image processor, reconstruction L2 (teacher-forced, on the test images), linear probe
(frozen mean-pooled features, logistic regression, ``C`` chosen on 20 % of the probe images) and
fine-tuning (the whole network, on the probe images), both scored on the test images.

Reconstruction L2 is measured for every row in one space, the per-patch normalised patch (each patch
minus its mean, over its standard deviation): p2p rows regress exactly that (``--norm_pix_loss``, MAE's
target); p2d and d2d rows predict a visual-token id, which is decoded to its codebook centroid (a
normalised patch) and compared with the true normalised patch. The ``codebook floor`` column is the same
error of the nearest centroid: no id prediction can do better.

Several runs share the one GPU at a time (``--jobs`` processes; small models leave it mostly idle). One
JSON per run lands in ``--out_dir``; a run whose JSON exists is skipped, so a stopped grid resumes where it
stopped. ``--time_limit`` stops launching and ends the runs in flight at that many seconds (their JSON is
not written; run the command again to finish them). ``--report`` rebuilds the markdown table from the JSON
files alone. After the grid, one extra run (p2d, GVP mixed, class condition tokens, seed 0) is sampled with
``hf-lookaround vision sample`` into ``samples.png``.

GPU (one H100; the Fashion-MNIST IDX files under ``<data_root>/images/fashion-mnist``)::

    PYTHONPATH=src python benchmarks/vision_bench.py --data_root .devdata --out_dir runs/vision_bench

CPU smoke (a tiny grid, a few minutes on 2 cores)::

    PYTHONPATH=src python benchmarks/vision_bench.py --smoke --out_dir runs/vision_smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> arguments of `hf-lookaround vision` that make the configuration (on top of the shared ones)
CONFIGS = {
    "p2p, GVP mixed": ["--objective", "gvp", "--segmentation", "mixed", "--target_mode", "p2p", "--norm_pix_loss"],
    "p2p, GVP fixed": ["--objective", "gvp", "--segmentation", "fixed", "--target_mode", "p2p", "--norm_pix_loss"],
    "p2d, GVP mixed": ["--objective", "gvp", "--segmentation", "mixed", "--target_mode", "p2d"],
    "p2d, GVP fixed": ["--objective", "gvp", "--segmentation", "fixed", "--target_mode", "p2d"],
    "d2d, GVP mixed": ["--objective", "gvp", "--segmentation", "mixed", "--target_mode", "d2d"],
    "d2d, GVP fixed": ["--objective", "gvp", "--segmentation", "fixed", "--target_mode", "d2d"],
    "MAE baseline (variable mask), p2p": ["--objective", "vmlm", "--target_mode", "p2p", "--norm_pix_loss"],
}
# the runs of this configuration also measure the baselines (untrained probe, raw pixels, fine-tuning from scratch)
BASELINE = "MAE baseline (variable mask), p2p"
# one more run, for the sample grid only (not in the table's comparisons)
SAMPLE_CONFIG = ("p2d, GVP mixed, class-conditional",
                 CONFIGS["p2d, GVP mixed"] + ["--class_conditional"])

GPU = dict(preset="small", num_train=50000, num_probe_train=10000, num_test=10000, max_steps=800, batch_size=256,
           learning_rate=1e-3, finetune_steps=300, codebook_size=512, codebook_images=5000, jobs=11, time_limit=570,
           extra=["--bf16", "--probe_backend", "sklearn_path", "--dataloader_num_workers", "1"])
SMOKE = dict(preset="tiny", num_train=192, num_probe_train=160, num_test=160, max_steps=3, batch_size=32,
             learning_rate=1e-3, finetune_steps=2, codebook_size=16, codebook_images=64, jobs=2, time_limit=None,
             extra=["--probe_backend", "sklearn_path"])


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-").replace("--", "-")


def run_command(python: str, shared: list[str], config_args: list[str], seed: int, out: Path) -> list[str]:
    return [python, "-m", "hf_lookaround.cli", "vision", *shared, *config_args, "--seed", str(seed), "--output_dir", str(out)]


def shared_args(args, sizes: dict, data_dir: str | None) -> list[str]:
    out = ["--dataset", args.dataset]
    if data_dir:
        out += ["--data", data_dir]
    if args.patch_size:  # default: the data set's (fashion_mnist 28x28 in 4x4 patches, digits 16x16 in 2x2)
        out += ["--patch_size", str(args.patch_size)]
    out += ["--preset", sizes["preset"], "--num_groups", "20",
            "--num_train", str(sizes["num_train"]), "--num_probe_train", str(sizes["num_probe_train"]),
            "--num_test", str(sizes["num_test"]), "--max_steps", str(sizes["max_steps"]),
            "--batch_size", str(sizes["batch_size"]), "--learning_rate", str(sizes["learning_rate"]),
            "--finetune_steps", str(sizes["finetune_steps"]), "--codebook_size", str(sizes["codebook_size"]),
            "--codebook_images", str(sizes["codebook_images"]), "--no_generative", *sizes["extra"]]
    return out


class Grid:
    """Runs `hf-lookaround vision` commands in parallel processes; one JSON per finished run."""

    def __init__(self, args, sizes):
        self.args, self.sizes = args, sizes
        self.out_dir = Path(args.out_dir).resolve()  # the runs start in the repository root
        self.deadline = time.monotonic() + sizes["time_limit"] if sizes["time_limit"] else None
        self.procs: dict[str, subprocess.Popen] = {}
        threads = max(1, (os.cpu_count() or 2) // max(1, sizes["jobs"]))
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                    "OPENBLAS_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}

    def result_path(self, name: str, seed: int) -> Path:
        return self.out_dir / f"{slug(name)}-seed{seed}.json"

    def one(self, name: str, config_args: list[str], seed: int, shared: list[str]) -> str:
        path = self.result_path(name, seed)
        if path.exists():
            return f"skip  {path.name} (done)"
        if self.deadline and time.monotonic() > self.deadline:
            return f"stop  {path.name}: past --time_limit, not started"
        run_dir = self.out_dir / "runs" / path.stem
        cmd = run_command(self.args.python, shared, config_args, seed, run_dir)
        log = self.out_dir / "logs" / f"{path.stem}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
            self.procs[path.stem] = proc
            timeout = None if self.deadline is None else max(1.0, self.deadline - time.monotonic())
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                return f"stop  {path.name}: ended at --time_limit after {time.monotonic() - start:.0f} s (run again)"
            finally:
                self.procs.pop(path.stem, None)
        wall = time.monotonic() - start
        results_file = run_dir / "vision_results.json"
        if rc != 0 or not results_file.exists():
            tail = log.read_text()[-1500:]
            return f"FAIL  {path.name} (exit {rc}, {wall:.0f} s); log {log}:\n{tail}"
        results = json.loads(results_file.read_text())
        # paths relative to --out_dir: the JSON files can be committed and moved (no machine paths in them)
        command = ["python", *cmd[1:-1], str(run_dir.relative_to(self.out_dir))]
        record = {"config": name, "seed": seed, "config_args": config_args, "command": command,
                  "wall_seconds": round(wall, 1), "checkpoint": str(run_dir.relative_to(self.out_dir)),
                  "results": results}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(path)  # a JSON exists only for a finished run
        return f"done  {path.name} in {wall:.0f} s (pretraining {results['seconds'].get('pretraining', 0):.0f} s)"

    def run(self, jobs_list) -> list[str]:
        messages = []
        with ThreadPoolExecutor(max_workers=self.sizes["jobs"]) as pool:
            futures = [pool.submit(self.one, *job) for job in jobs_list]
            for future in as_completed(futures):
                message = future.result()
                messages.append(message)
                print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
        return messages


# --------------------------------------------------------------------------------------------- report
def mean_sd(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None, 0
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None), len(values)


def fmt(values, digits=3):
    m, sd, n = mean_sd(values)
    if m is None:
        return "–"
    return f"{m:.{digits}f} ± {sd:.{digits}f}" if sd is not None else f"{m:.{digits}f} (1 seed)"


def load_records(out_dir: Path) -> dict[str, list[dict]]:
    records: dict[str, list[dict]] = {}
    for path in sorted(out_dir.glob("*-seed*.json")):
        record = json.loads(path.read_text())
        records.setdefault(record["config"], []).append(record)
    return records


def metrics(record) -> dict:
    r = record["results"]
    recon = r.get("reconstruction_l2", {}).get("teacher_forced", {})
    return {
        "probe": r.get("linear_probe", {}).get("pretrained"),
        "finetune": r.get("finetune_test_accuracy", {}).get("pretrained"),
        "l2": recon.get("l2"),
        "floor": recon.get("codebook_l2"),
        "expected": recon.get("expected_centroid_l2"),
        "token_acc": recon.get("token_accuracy"),
        "mean_patch_l2": r.get("reconstruction_l2", {}).get("mean_image_baseline", {}).get("l2"),
        "probe_untrained": r.get("linear_probe", {}).get("random_init"),
        "probe_raw": r.get("linear_probe", {}).get("raw_pixels"),
        "finetune_scratch": r.get("finetune_test_accuracy", {}).get("from_scratch"),
        "pretrain_s": r.get("seconds", {}).get("pretraining"),
        "wall_s": record.get("wall_seconds"),
    }


def compare(records, a: str, b: str, key: str = "probe") -> tuple[str, int | None]:
    """``a`` vs ``b`` on ``key``. A difference is called only where it exceeds the seed spread, the sum of the
    two standard deviations (the mean ± sd intervals do not overlap). Returns the text and the sign of the
    called difference (+1: a > b, -1: a < b, 0: within the spread, None: too few seeds)."""
    ma, sa, na = mean_sd([metrics(r)[key] for r in records.get(a, [])])
    mb, sb, nb = mean_sd([metrics(r)[key] for r in records.get(b, [])])
    if na == 0 or nb == 0:
        return "", None  # a configuration of the comparison was not run: no line
    if na < 2 or nb < 2:
        return f"not enough seeds to compare ({na} and {nb})", None
    diff, spread = ma - mb, sa + sb
    sign = 1 if diff > spread else -1 if diff < -spread else 0
    verdict = {1: f"{a} > {b}", -1: f"{a} < {b}", 0: "no difference beyond the seed spread"}[sign]
    return f"{verdict}: {diff:+.4f} (spread {spread:.4f}; {na} and {nb} seeds)", sign


CLAIM = {  # (claim, sign) -> what the data say about it
    ("greater", 1): "holds", ("greater", 0): "not shown (within the seed spread)", ("greater", -1): "fails (reversed)",
    ("at_least", 1): "holds (p2d > p2p)", ("at_least", 0): "consistent (no difference beyond the seed spread)",
    ("at_least", -1): "fails (p2d < p2p)",
}


def report(out_dir: Path, sizes: dict | None = None) -> str:
    records = load_records(out_dir)
    if not records:
        return f"no run results (*-seed*.json) in {out_dir}"
    lines = ["| pretraining | seeds | linear probe acc | fine-tune acc | recon L2 (teacher-forced) | L2, softmax-mean "
             "centroid | codebook floor L2 | token acc | pretraining s / run |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    order = [name for name in list(CONFIGS) + [SAMPLE_CONFIG[0]] if name in records]
    for name in order:
        m = [metrics(r) for r in records[name]]
        col = lambda k, d=3: fmt([x[k] for x in m], d)  # noqa: E731
        lines.append(f"| {name} | {len(m)} | {col('probe')} | {col('finetune')} | {col('l2', 4)} | {col('expected', 4)} "
                     f"| {col('floor', 4)} "
                     f"| {col('token_acc')} | {fmt([x['pretrain_s'] for x in m], 0)} |")
    base = [metrics(r) for r in records.get(BASELINE, [])]
    every = [metrics(r) for rs in records.values() for r in rs]
    lines += [
        "",
        "Baselines (measured in the MAE baseline's runs; none here)." if not base else
        "Baselines: linear probe on raw pixels " + fmt([x["probe_raw"] for x in base]) +
        ", on the untrained ViT " + fmt([x["probe_untrained"] for x in base]) +
        "; fine-tuning from scratch " + fmt([x["finetune_scratch"] for x in base]) +
        " (the same images and steps; measured in the MAE baseline's runs, one per seed); reconstruction by the "
        "mean training patch at each position " + fmt([x["mean_patch_l2"] for x in every if x["mean_patch_l2"]], 4) +
        " (over every run's own plans).",
    ]
    first = next(iter(records.values()))[0]
    r = first["results"]
    lines += [
        "",
        f"Setup: {r['dataset']['name']} {r['dataset']['image_size']}x{r['dataset']['image_size']}, patch "
        f"{r['dataset']['patch_size']} ({r['num_parameters'] / 1e6:.2f} M parameters in the first run), "
        f"{r['num_pretrain_images']} pretraining images, {r['max_steps']} steps; probe and fine-tuning on "
        f"{r['num_probe_images']} other train images, scored on {r['num_test_images']} test images. Recon L2: mean "
        f"squared error per value over the target patches of each run's seeded plan, in per-patch normalised "
        f"patch space (p2p: the regressed normalised patch; p2d/d2d: the codebook centroid of the most likely id); "
        f"softmax-mean centroid: p2d/d2d decoded as the probability-weighted mean of the centroids (the least "
        f"expected squared error; argmax decoding pays for every wrong guess); codebook floor: the nearest "
        f"centroid's error. Mean ± sample standard deviation over seeds.",
        "",
        "### Do the paper's claims hold here? (paper (b): mixed > fixed; p2d >= p2p on linear probing)",
        "",
        "A difference is called only where it exceeds the seed spread (the sum of the two standard deviations).",
        "",
    ]
    # (label, a, b, metric, claim): claim names how to read the sign against paper (b), None for context rows
    comparisons = [(f"mixed vs fixed segmentation, {m}, linear probe", f"{m}, GVP mixed", f"{m}, GVP fixed", "probe",
                    ("greater", "mixed > fixed")) for m in ("p2p", "p2d", "d2d")]
    comparisons += [(f"p2d vs p2p, GVP {g}, linear probe", f"p2d, GVP {g}", f"p2p, GVP {g}", "probe",
                     ("at_least", "p2d >= p2p")) for g in ("mixed", "fixed")]
    comparisons += [(f"{m} GVP mixed vs the MAE baseline, linear probe", f"{m}, GVP mixed", BASELINE, "probe", None)
                    for m in ("p2p", "p2d", "d2d")]
    comparisons += [(f"mixed vs fixed, {m}, fine-tuning", f"{m}, GVP mixed", f"{m}, GVP fixed", "finetune", None)
                    for m in ("p2p", "p2d", "d2d")]
    for label, a, b, key, claim in comparisons:
        text, sign = compare(records, a, b, key=key)
        if text:
            verdict = "" if sign is None or claim is None else f" — {claim[1]} {CLAIM[(claim[0], sign)]}"
            lines.append(f"- {label}: {text}{verdict}")
    walls = [x["wall_s"] for x in every if x["wall_s"]]
    if walls:
        lines += ["", f"{len(walls)} runs, {sum(walls) / 60:.1f} run-minutes in all (runs overlap: --jobs at a time)."]
    if (out_dir / "samples.png").exists():
        lines += ["", f"Samples: samples.png ({SAMPLE_CONFIG[0]}, seed 0; 100 images, image i of class i mod 10)."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_root", default="../shared/data",
                   help="the shared data layout: the Fashion-MNIST IDX files in images/fashion-mnist")
    p.add_argument("--dataset", default="fashion_mnist", help="fashion_mnist (default), digits, or a datasets image set")
    p.add_argument("--out_dir", default="runs/vision_bench")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", nargs="+", default=None, help=f"a subset of: {list(CONFIGS)}")
    p.add_argument("--smoke", action="store_true", help="a tiny CPU grid: tiny preset, a few steps, few images")
    p.add_argument("--report", action="store_true", help="only rebuild report.md from the JSON files in --out_dir")
    p.add_argument("--no_sample", action="store_true", help="skip the class-conditional p2d run and its samples.png")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds: stop launching runs and end those in flight (they are redone by the next call); "
                        "default 570 on the GPU grid (the device's commands end at 600 s), none with --smoke")
    p.add_argument("--python", default=sys.executable)
    for key in ("jobs", "max_steps", "finetune_steps", "num_train", "num_probe_train", "num_test", "batch_size",
                "codebook_size", "codebook_images"):
        p.add_argument(f"--{key}", type=int, default=None, help="override the grid's default")
    p.add_argument("--preset", default=None)
    p.add_argument("--patch_size", type=int, default=None)
    args = p.parse_args(argv)
    sizes = dict(SMOKE if args.smoke else GPU)
    for key in list(sizes):
        if getattr(args, key, None) is not None:
            sizes[key] = getattr(args, key)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
        text = report(out_dir)
        (out_dir / "report.md").write_text(text + "\n")
        print(text)
        return 0

    data_dir = None
    if args.dataset == "fashion_mnist":
        found = (Path(args.data_root) / "images" / "fashion-mnist").resolve()
        # the runs start in the repository root; a relative path keeps machine paths out of the JSON files
        data_dir = os.path.relpath(found, REPO)
        if not (found / "train-images-idx3-ubyte.gz").exists():
            print(f"error: no Fashion-MNIST IDX files in {found}; pass --data_root (the folder holding "
                  f"images/fashion-mnist) or --dataset digits", file=sys.stderr)
            return 2
    shared = shared_args(args, sizes, data_dir)
    configs = args.configs or list(CONFIGS)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"error: unknown configs {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    jobs = []
    for seed in args.seeds:  # seed-major: a grid stopped early has every configuration at the first seeds
        for name in configs:
            extra = [] if name == BASELINE else ["--no_baselines"]
            jobs.append((name, CONFIGS[name] + extra, seed, shared))
    if not args.no_sample:
        jobs.append((SAMPLE_CONFIG[0], SAMPLE_CONFIG[1] + ["--no_baselines"], args.seeds[0], shared))
    grid = Grid(args, sizes)
    sample_record = grid.result_path(SAMPLE_CONFIG[0], args.seeds[0])
    png = out_dir / "samples.png"
    if not args.no_sample and sample_record.exists() and not png.exists() and not (
            out_dir / json.loads(sample_record.read_text())["checkpoint"] / "config.json").exists():
        sample_record.unlink()  # its checkpoint is gone (a fresh machine got the JSON files only): train it again
    start = time.monotonic()
    print(f"{len(jobs)} runs, {sizes['jobs']} at a time, into {out_dir}", flush=True)
    messages = grid.run(jobs)
    failed = [m for m in messages if m.startswith("FAIL")]
    if not args.no_sample and sample_record.exists() and not png.exists() and not (
            grid.deadline and time.monotonic() > grid.deadline - 20):
        checkpoint = str(out_dir / json.loads(sample_record.read_text())["checkpoint"])
        # 100 images, image i of class i mod 10: one class per column of the 10 x 10 grid
        cmd = [args.python, "-m", "hf_lookaround.cli", "vision", "sample", "--model", checkpoint, "--out", str(png),
               "--num_images", "100", "--seed", "0"]
        print("sampling:", " ".join(cmd[1:]), flush=True)
        timeout = None if grid.deadline is None else max(1.0, grid.deadline - time.monotonic())
        try:
            rc = subprocess.run(cmd, env=grid.env, cwd=REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "stopped at --time_limit"
        if rc != 0 or not png.exists():
            failed.append(f"FAIL  sampling (exit {rc})")
        elif png.stat().st_size > 1_000_000:
            failed.append(f"FAIL  {png} is {png.stat().st_size / 1e6:.2f} MB (over 1 MB)")
    text = report(out_dir)
    (out_dir / "report.md").write_text(text + "\n")
    print(text)
    print(f"\nwall clock {time.monotonic() - start:.0f} s; report in {out_dir / 'report.md'}")
    stopped = [m for m in messages if m.startswith("stop")]
    if stopped:
        print(f"{len(stopped)} of {len(jobs)} runs not finished (--time_limit): run the same command again to "
              f"finish them (finished runs are skipped)", flush=True)
        return 3
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
