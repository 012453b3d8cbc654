"""benchmarks/diffusion_bench.py (issue 40's GPU benchmark): the resumable plan and the report's rules, on
synthetic records (the whole pipeline runs with `python benchmarks/diffusion_bench.py --smoke`)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

_spec = importlib.util.spec_from_file_location(
    "diffusion_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "diffusion_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _args(**kw):
    return SimpleNamespace(**{"cells": list(bench.CELLS), "seeds": [0, 1, 2], "decode": True, **kw})


def _record(cell, seed, ppl, key="ar_perplexity", se=None):
    return {"cell": cell, "seed": seed, "tokens": 1000, "perplexity": {key: ppl, "standard_error": se}}


def test_plan_skips_finished_cells_and_reruns_a_decoding_model_missing_here(tmp_path):
    done = {bench.cell_name(c, s): {} for c in bench.CELLS for s in (0, 1)}
    jobs = bench.plan(_args(), done, decoding_done=False, work=tmp_path)
    names = [j["name"] for j in jobs]
    # seed 2 of every cell, the decoding job's seed-0 cells again (their models are not on this machine): ar,
    # bd3lm-b4 and, since it is in the cells, BD3-LM's one-stream form
    needs = bench.decode_needs(bench.CELLS)
    assert needs == ("ar", "bd3lm-b4", "bd3lm-b4-1s")
    assert names[:3] == ["ar__s0", "bd3lm-b4__s0", "bd3lm-b4-1s__s0"] and all(j["rerun_for_decoding"] for j in jobs[:3])
    assert sorted(names[3:-1]) == sorted(bench.cell_name(c, 2) for c in bench.CELLS)
    assert names[-1] == "decoding" and jobs[-1]["exclusive"]
    assert jobs[-1]["needs"] == ["ar__s0", "bd3lm-b4__s0", "bd3lm-b4-1s__s0"]
    two_stream_only = [c for c in bench.CELLS if c != "bd3lm-b4-1s"]  # without the one-stream cell: the two
    jobs = bench.plan(_args(cells=two_stream_only), done, decoding_done=False, work=tmp_path)
    assert [j["name"] for j in jobs[:2]] == ["ar__s0", "bd3lm-b4__s0"] and jobs[2]["name"] == "ar__s2"
    assert jobs[-1]["needs"] == ["ar__s0", "bd3lm-b4__s0"]
    for cell in needs:  # the models are here: nothing is rerun
        model = tmp_path / "cells" / bench.cell_name(cell, 0) / "model"
        model.mkdir(parents=True)
        (model / "model.safetensors").write_bytes(b"")
    names = [j["name"] for j in bench.plan(_args(), done, decoding_done=False, work=tmp_path)]
    assert "ar__s0" not in names and "decoding" in names
    assert [j["name"] for j in bench.plan(_args(seeds=[0, 1]), done, decoding_done=True, work=tmp_path)] == []


def test_decoding_starts_without_a_failed_one_stream_cell_but_never_without_ar_or_bd3lm(tmp_path):
    (job,) = [j for j in bench.plan(_args(), {}, decoding_done=False, work=tmp_path) if j["name"] == "decoding"]
    ok = {"ar__s0": 0, "bd3lm-b4__s0": 0}
    assert not bench.needs_met(job, ok, waiting={"bd3lm-b4-1s__s0"})  # the one-stream cell still runs: wait
    assert not bench.needs_met(job, {**ok, "bd3lm-b4-1s__s0": 0}, waiting={"bd3lm-b4-1s__s0"})  # rerun pending
    assert bench.needs_met(job, {**ok, "bd3lm-b4-1s__s0": 0}, waiting=set())
    assert bench.needs_met(job, {**ok, "bd3lm-b4-1s__s0": 1}, waiting=set())  # failed: decode without its rows
    assert not bench.needs_met(job, {**ok, "bd3lm-b4-1s__s0": 0, "ar__s0": -9}, waiting=set())  # ar killed
    cell = {"needs": []}
    assert bench.needs_met(cell, {}, waiting=set())


def test_decoding_target_against_the_faster_compiled_ar_row():
    rows = [dict(decoder="ar a", kind="baseline", mode="greedy", batch=1, new_tokens_per_s=100.0, gen_ppl=10.0),
            dict(decoder="ar b", kind="baseline", mode="greedy", batch=1, new_tokens_per_s=200.0, gen_ppl=12.0),
            dict(decoder="fast, worse", kind="diffusion", mode="greedy", batch=1, new_tokens_per_s=900.0, gen_ppl=13.3),
            dict(decoder="fast, close", kind="diffusion", mode="greedy", batch=1, new_tokens_per_s=500.0, gen_ppl=13.1),
            dict(decoder="slow", kind="diffusion", mode="greedy", batch=1, new_tokens_per_s=400.0, gen_ppl=11.0),
            dict(decoder="broken", kind="diffusion", mode="greedy", batch=1, error="RuntimeError: x")]
    for r in rows[:-1]:
        r.update(forwards=128, tokens_per_forward=1.0, graphs_compiled_after_warmup=0)
    out = bench.summarise_decoding({"rows": rows})
    (verdict,) = out["target"]["by_setting"]
    assert verdict["baseline"] == "ar b" and verdict["met"] and verdict["best_meeting_target"] == "fast, close"
    assert [r.get("meets_target") for r in out["rows"]] == [False, False, False, True, False, None]
    assert "met by fast, close" in bench.decoding_table(out)


def test_likelihood_table_and_the_published_ordering():
    cells = {"a": _record("ar", 0, 20.0), "b": _record("ar", 1, 22.0),
             "c": _record("bd3lm-b4", 0, 25.0, "elbo_perplexity", 0.01), "d": _record("mdlm", 0, 30.0, "elbo_perplexity")}
    rows, table = bench.likelihood_table(cells, {})
    assert [r["cell"] for r in rows] == ["ar", "mdlm", "bd3lm-b4"] and rows[0]["mean"] == 21.0
    assert "| vmlm | masked prefix | not run yet |" in table and "≤ 25.00" in table
    assert "agrees" in bench.ordering(rows) and "does not" not in bench.ordering(rows)
    cells["d"]["perplexity"]["elbo_perplexity"] = 24.0
    assert "does not agree" in bench.ordering(bench.likelihood_table(cells, {})[0])
