"""Collator cost per batch, on one CPU thread: the vectorised plans against the per-row loop they replaced.

Each objective's training collator is built exactly as ``hf-lookaround pretrain`` builds it (``build_collators``
with the default objective parameters and static target widths, as under ``--torch_compile``) and called on
blocks of ``T`` token ids given as numpy rows (what ``pretrain`` hands it: ``rows_as_numpy``). The time of one
call is the median (and the minimum) of ``--repeats`` calls after a warm-up, with ``torch.set_num_threads(1)``.

Columns (milliseconds per batch, minimum / median of the calls; on a shared machine the minimum is the better
estimate of the cost):

- ``collator``: the full call (padding, per-batch seed, plan, labels, target positions);
- ``as pretrain runs it``: the collator as ``pretrain --torch_compile`` wraps it by default (mlm, vmlm and gvp
  leave out their unread content rows in the data loader: ``DropUnreadContent``); the same as ``collator`` for
  the others;
- ``collator, ids as lists``: the same with each example's ids as a list of Python ints (a block dataset with
  no format): reading the ints is then most of the call;
- ``plan``: ``objectives.make_plan`` alone;
- ``plan, per-row loop``: the plans as drawn before (``reference_make_plan``, kept in
  ``tests/test_plans.py``), and ``collator, per-row loop``: the full call with those plans.

Rows ``dar, one stream`` and ``mixture, one stream`` are the one-stream forms (``--dar_form single_stream``, and
``--masked_form single_stream`` for the mixture's masked rows), on the same ``T`` ids (their batches are ``T + 2``
wide). ``--threads 16``: the collator on torch's threads as in a main process that collates itself (a data
loader worker runs on one thread); a collator whose ``(B, T)`` work is numpy's costs the same on any number.

Run: ``python benchmarks/collator_bench.py --out collator_bench.json`` (``--smoke``: T=64, B=2 and 4, few
repeats). ``collator_times`` is the function ``benchmarks/gpu_bench.py`` imports to set collator time against
the compiled GPU step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from hf_lookaround.objectives import make_plan
from hf_lookaround.training.pretraining import ObjectiveArguments, build_collators, without_unread_content

OBJECTIVES = ("ar", "dar", "mlm", "vmlm", "gvp", "mixture")
MIXTURE = ["dar=0.5", "vmlm=0.5"]  # the mixture measured: UL2-style, half semi-AR, half variable masking
ONE_STREAM = {"dar, one stream": dict(dar_form="single_stream"),
              "mixture, one stream": dict(dar_form="single_stream", masked_form="single_stream")}
ROWS = OBJECTIVES + tuple(ONE_STREAM)
REFERENCE_FILE = Path(__file__).resolve().parent.parent / "tests" / "test_plans.py"


class BenchTokenizer:
    """The attributes a collator reads from a tokenizer (a BPE vocabulary of 8,192 ids)."""

    pad_token_id, bos_token_id, eos_token_id, mask_token_id = 0, 1, 2, 3
    cls_token_id = sep_token_id = None

    def __len__(self):
        return 8192


def blocks(batch_size: int, seq_len: int, seed: int = 0, as_arrays: bool = False) -> list[dict]:
    """``batch_size`` blocks ``<s> w ... w`` of ``seq_len`` ids, as lists of ints (what a block dataset with no
    format yields) or, with ``as_arrays``, as int64 numpy arrays (``dataset.with_format("numpy")``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, len(BenchTokenizer()), (batch_size, seq_len), generator=g)
    ids[:, 0] = BenchTokenizer.bos_token_id
    if as_arrays:
        return [{"input_ids": row} for row in ids.numpy()]
    return [{"input_ids": row} for row in ids.tolist()]


def objective_of(row: str) -> str:
    """The objective a row measures (``"mixture, one stream"``: ``mixture``)."""
    return row.split(",")[0]


def objective_arguments(row: str) -> ObjectiveArguments:
    objective = objective_of(row)
    return ObjectiveArguments(objective=objective, mixture=MIXTURE if objective == "mixture" else [],
                              **ONE_STREAM.get(row, {}))


def training_collator(objective: str, seq_len: int):
    collator, _ = build_collators(objective_arguments(objective), BenchTokenizer(), seed=0, block_size=seq_len,
                                  static_shapes=True)
    return collator


def as_pretrain_runs_it(objective: str, seq_len: int):
    """The training collator wrapped as `pretrain --torch_compile` wraps it with its defaults."""
    defaults = SimpleNamespace(drop_unread_content=None, torch_compile=True)
    return without_unread_content(training_collator(objective, seq_len), objective_arguments(objective), defaults,
                                  block_size=seq_len)


def median_seconds(call, repeats: int, warmup: int = 3) -> tuple[float, float]:
    """(median, minimum) seconds of ``call()`` over ``repeats`` calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


@contextlib.contextmanager
def torch_threads(threads: int = 1):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def collator_times(batch_sizes=(16, 64), seq_len: int = 1024, objectives=OBJECTIVES, *, batch_size: int | None = None,
                   repeats: int = 30, data_root=None) -> dict:
    """Median seconds of one training-collator call per objective (ids as numpy rows), on one CPU thread.

    Returns ``{batch_size: {objective: seconds}}`` for ``batch_sizes``, or ``{objective: seconds}`` when a
    single ``batch_size`` is given (how ``gpu_bench.py`` calls it). ``data_root`` is accepted for that caller and
    not read: a collator's cost depends on the batch's shape, not on which token ids it holds.
    """
    del data_root
    unknown = set(objectives) - set(ROWS)
    if unknown:
        raise ValueError(f"unknown objective(s) {sorted(unknown)}; choose from {ROWS}")
    sizes = (batch_size,) if batch_size is not None else tuple(batch_sizes)
    out: dict = {}
    with torch_threads(1):
        for b in sizes:
            features = blocks(b, seq_len, as_arrays=True)
            out[b] = {}
            for objective in objectives:
                collator = training_collator(objective, seq_len)
                out[b][objective] = median_seconds(lambda: collator(features), repeats)[0]
    return out[batch_size] if batch_size is not None else out


def load_reference():
    """``reference_make_plan``: the per-row plans, from the test file that keeps them."""
    spec = importlib.util.spec_from_file_location("plans_reference", REFERENCE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_make_plan


def measure(batch_sizes, seq_len: int, objectives, repeats: int, reference: bool, threads: int = 1) -> list[dict]:
    reference_make_plan = load_reference() if reference else None
    rows = []
    with torch_threads(threads):
        for b in batch_sizes:
            features, lists = blocks(b, seq_len, as_arrays=True), blocks(b, seq_len)
            for objective in objectives:
                collator, wrapped = training_collator(objective, seq_len), as_pretrain_runs_it(objective, seq_len)
                params = dict(objective_arguments(objective).plan_params(), num_condition_tokens=1)
                lengths = torch.full((b,), seq_len)
                generator = torch.Generator().manual_seed(0)
                name = objective_of(objective)
                row = dict(objective=objective, batch_size=b, seq_len=seq_len, threads=threads, params=params)
                def timed(name, call):
                    row[f"{name}_ms"], row[f"{name}_min_ms"] = (1e3 * t for t in median_seconds(call, repeats))

                timed("collator", lambda: collator(features))
                timed("as_pretrain", lambda: wrapped(features))
                timed("collator_lists", lambda: collator(lists))
                timed("plan", lambda: make_plan(name, lengths, seq_len, generator=generator, **params))
                if reference and name != "mixture":  # the per-row loop predates mixtures
                    timed("reference_plan", lambda: reference_make_plan(name, lengths, seq_len,
                                                                        generator=generator, **params))
                    reference_plan = staticmethod(lambda *a, **k: reference_make_plan(name, *a, **k))
                    with mock.patch.object(type(collator), "plan_function", reference_plan):
                        timed("reference_collator", lambda: collator(features))
                rows.append(row)
                print(f"  {objective} B={b}: collator {row['collator_ms']:.3f} ms", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Milliseconds per batch, minimum / median of the calls."""
    reference = any("reference_plan_ms" in r for r in rows)
    cell = lambda r, name: f"{r[name + '_min_ms']:.2f} / {r[name + '_ms']:.2f}" if name + "_ms" in r else "–"  # noqa: E731
    head = "| objective | B | T | collator | as pretrain runs it | collator, ids as lists | plan |"
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    if reference:
        head += " plan, per-row loop | plan speed-up (min) | collator with per-row plans |"
        rule += " ---: | ---: | ---: |"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['objective']} | {r['batch_size']} | {r['seq_len']} | {cell(r, 'collator')} | "
                f"{cell(r, 'as_pretrain')} | {cell(r, 'collator_lists')} | {cell(r, 'plan')} |")
        if reference:
            speedup = f"{r['reference_plan_min_ms'] / r['plan_min_ms']:.1f}x" if "reference_plan_ms" in r else "–"
            line += f" {cell(r, 'reference_plan')} | {speedup} | {cell(r, 'reference_collator')} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--objectives", nargs="+", default=list(ROWS), choices=ROWS,
                        help="rows to measure; a one-stream row is quoted: 'mixture, one stream'")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: as in a data loader worker; more: a main process that collates)")
    parser.add_argument("--repeats", type=int, default=50, help="calls per measurement (the median is reported)")
    parser.add_argument("--no_reference", action="store_true", help="skip the per-row reference loop")
    parser.add_argument("--smoke", action="store_true", help="T=64, B=2 and 4, 5 repeats: checks that it runs")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.seq_len, args.repeats = [2, 4], 64, 5
    rows = measure(args.batch_sizes, args.seq_len, args.objectives, args.repeats, reference=not args.no_reference,
                   threads=args.threads)
    text = table(rows)
    print("milliseconds per batch, minimum / median of", args.repeats, "calls,", args.threads, "torch thread(s)")
    print(text)
    if args.out:
        meta = dict(torch=torch.__version__, python=platform.python_version(), processor=platform.processor(),
                    machine=platform.machine(), threads=args.threads, repeats=args.repeats, statistic="minimum and median")
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows, table=text), indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
