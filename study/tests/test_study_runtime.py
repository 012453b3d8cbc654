"""The runtime side of the seeded study (study/study_{data,cell,grid}.py): data preparation, the learning-rate
sweep and the rate the grid takes from it, the GPU assignment, fine-tuning rates selected on validation, the
per-example scores of a cell, ``--only_cell`` and resume. One real run on a tiny synthetic corpus (CPU, about a
minute): two sweep runs, then one cell.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import study
import study_cell
import study_common
import study_data
import study_grid


# ---------------------------------------------------------------------------------------------
# pure pieces
# ---------------------------------------------------------------------------------------------
def test_gpu_assignment_spreads_the_first_wave_and_refills_free_slots():
    keys = [f"small__o{i}__seed0" for i in range(7)]
    first = study_grid.assign_gpus(keys, ["0", "1", "2"], cells_per_gpu=2)
    assert list(first) == keys[:6]  # 3 GPUs x 2 slots; the seventh waits
    assert [first[k] for k in keys[:6]] == ["0", "1", "2", "0", "1", "2"]  # round robin, seed-major order kept
    assert study_grid.next_gpu({"0": 2, "1": 1, "2": 2}, 2) == "1"
    assert study_grid.next_gpu({"0": 2, "1": 2}, 2) is None
    assert study_grid.assign_gpus(keys[:2], ["cpu"], cells_per_gpu=4) == {keys[0]: "cpu", keys[1]: "cpu"}


def test_visible_gpus_follow_the_device_count_and_cuda_visible_devices(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert study_grid.visible_gpus("cuda") == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert study_grid.visible_gpus("cuda") == ["3", "5"]
    assert study_grid.visible_gpus("cpu") == ["cpu"]


def test_keys_and_job_order():
    assert study_common.parse_key("small__vmlm-0.15-0.3__seed2") == {
        "kind": "cell", "preset": "small", "objective": "vmlm-0.15-0.3", "seed": 2}
    k = study_common.parse_key(study_common.sweep_key("small", "ar", 0.0005))
    assert (k["kind"], k["objective"], k["learning_rate"]) == ("sweep", "ar", 0.0005)
    with pytest.raises(ValueError, match="not a cell key"):
        study_common.parse_key("small__ar")
    args = study._parser().parse_args(["--objectives", "ar", "mlm-0.3", "--seeds", "0", "1"])
    assert [j["key"] for j in study_grid.plan_jobs(args)] == [
        "small__ar__seed0", "small__mlm-0.3__seed0", "small__ar__seed1", "small__mlm-0.3__seed1"]
    args = study._parser().parse_args(["--sweep", "--objectives", "ar", "--sweep_lrs", "1e-3", "2e-3"])
    assert [j["key"] for j in study_grid.plan_jobs(args)] == ["sweep__small__ar__lr0.001", "sweep__small__ar__lr0.002"]
    args = study._parser().parse_args(["--only_cell", "small__gvp-k8__seed1"])
    assert [(j["kind"], j["seed"]) for j in study_grid.plan_jobs(args)] == [("cell", 1)]
    assert "mix-dar12-vmlm" in study._parser().parse_args([]).objectives  # in the default list


def _sweep_file(folder: Path, objective, lr, val, losses, data_id="d1"):
    key = study_common.sweep_key("small", objective, lr)
    payload = {"key": key, "kind": "sweep", "preset": "small", "objective": objective, "learning_rate": lr,
               "status": "ok", "settings": {"tokens": 1000, "batch_size": 64}, "prep": {"data_id": data_id},
               "pretrain": {"validation_loss": val, "logged_losses": losses}}
    study_common.write_json(folder / f"{key}.json", payload)


def test_the_grid_takes_the_lowest_validation_loss_among_runs_that_did_not_diverge(tmp_path):
    _sweep_file(tmp_path, "ar", 5e-4, 4.10, [8.0, 4.2])
    _sweep_file(tmp_path, "ar", 1e-3, 3.95, [8.0, 4.0])
    _sweep_file(tmp_path, "ar", 2e-3, 3.90, [8.0, 8.5])  # lowest validation loss, but ends above its first loss
    _sweep_file(tmp_path, "ar", 4e-3, float("nan"), [8.0, float("nan")])
    _sweep_file(tmp_path, "ar", 1e-4, 3.0, [8.0, 3.0], data_id="other")  # other data: never used
    lr, source = study_grid.choose_learning_rate(tmp_path, "small", "ar", data_id="d1")
    assert lr == 1e-3
    flags = {r["learning_rate"]: r["diverged"] for r in source["runs"]}
    assert flags == {5e-4: False, 1e-3: False, 2e-3: True, 4e-3: True}
    assert {r["file"] for r in source["runs"]} == {p.name for p in tmp_path.glob("*.json")} - {
        "sweep__small__ar__lr0.0001.json"}
    # 1.5 x the best rate's final training loss
    runs = [{"key": "a", "pretrain": {"validation_loss": 3.0, "logged_losses": [9.0, 3.0]}},
            {"key": "b", "pretrain": {"validation_loss": 5.0, "logged_losses": [9.0, 4.6]}}]
    assert study_grid.divergence(runs)["a"] == []
    assert study_grid.divergence(runs)["b"] and "1.5" in study_grid.divergence(runs)["b"][0]
    with pytest.raises(LookupError):
        study_grid.choose_learning_rate(tmp_path, "small", "mlm-0.3")


def test_fine_tuning_rate_is_selected_on_validation_not_test(monkeypatch):
    # the best test score is at another rate than the best validation score: the validation one is reported
    fake = {1e-4: (0.70, 0.90), 3e-4: (0.80, 0.60), 1e-3: (0.75, 0.95)}

    def finetune_one(ckpt, spec, task, mode, lr, log):
        val, test = fake[lr]
        return {"metric": "accuracy", "validation": val, "test": test, "test_predictions": [1, 0],
                "test_labels": [1, 1], "seconds": 0.1, "steps": 3, "train_samples": 10}

    monkeypatch.setattr(study_cell, "finetune_one", finetune_one)
    spec = {"settings": {"ft_modes": ["full"], "ft_lrs": list(fake), "lora_lrs": [], "ft_epochs": 3.0},
            "deadline_unix": 1e12}
    out = study_cell.finetune(None, spec, lambda m: None, lambda ft: None)
    for task in study_common.TASKS:
        entry = out["full"][task]
        assert entry["learning_rate"] == 3e-4 and entry["test"] == 0.60 and entry["validation"] == 0.80
        assert entry["validation_by_lr"] == {"0.0001": 0.7, "0.0003": 0.8, "0.001": 0.75}
        assert "test_by_lr" not in entry and entry["selected_on"] == "validation"
    assert study_cell.select_learning_rate({1e-3: 0.5, 1e-4: 0.5}) == 1e-4  # ties: the smaller rate


def test_per_passage_sums_and_prefix_ranges():
    nlls = [1.0, 2.0, 3.0, 4.0, 5.0]
    prefix = [0, 15, 16, 64, 100]
    out = study_cell.per_passage(nlls, prefix, [2, 3])
    assert out == {"nll_sum": [3.0, 12.0], "tokens": [2, 3], "short_nll_sum": [3.0, 0.0], "short_tokens": [2, 0],
                   "long_nll_sum": [0.0, 9.0], "long_tokens": [0, 2]}
    with pytest.raises(ValueError, match="sum to"):
        study_cell.per_passage(nlls, prefix, [2, 2])
    assert study_common.round_sig({"a": [1.234567, 12345.678, 0], "b": 7}) == {"a": [1.2346, 12346.0, 0], "b": 7}


def test_passages_of_a_long_text_lose_nothing():
    text = ("word " * 3 + "x" * 50 + " ") * 200
    pieces = study_data.passages(text, 40)
    assert all(0 < len(p) <= 40 for p in pieces)
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")


def test_mixture_objective_is_in_the_table_and_fails_only_when_run():
    kwargs = study_common.STUDY_OBJECTIVES["mix-dar12-vmlm"]
    assert kwargs == dict(objective="mixture", mixture=["dar=0.5", "vmlm=0.5"], group_size=[1, 2],
                          mask_ratio_range=[0.15, 0.3])
    from hf_lookaround import objectives

    if "mixture" in objectives.PLAN_NAMES:
        assert study_cell.objective_arguments(kwargs).objective == "mixture"
    else:
        with pytest.raises(ValueError, match="'mixture' is not in this version"):
            study_cell.objective_arguments(kwargs)


def test_the_grid_refuses_to_run_without_a_sweep_or_a_learning_rate(tmp_path):
    with pytest.raises(SystemExit, match="no learning-rate sweep"):
        study.main(["--smoke", "--work_dir", str(tmp_path / "w"), "--results_dir", str(tmp_path / "r"),
                    "--only_cell", "tiny__ar__seed0"])
    assert not (tmp_path / "w" / "cells").exists()


# ---------------------------------------------------------------------------------------------
# one real run: two sweep runs, then one cell (--only_cell), then a resume that starts nothing
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("study_runtime")
    corpus, data, bbc = study_data.write_synthetic_data(root / "data")
    common = ["--smoke", "--corpus_dir", str(corpus), "--data_root", str(data), "--bbc_dir", str(bbc),
              "--work_dir", str(root / "work"), "--results_dir", str(root / "results"), "--no_plots"]
    sweep = ["--sweep", "--objectives", "ar", "--sweep_lrs", "0.001", "0.004", "--run_label", "sw"]
    assert study.main(common + sweep) == 0
    assert study.main(common + ["--only_cell", "tiny__ar__seed0", "--run_label", "c1"]) == 0
    return root, common


def test_sweep_files_and_the_rate_the_cell_took(smoke):
    root, _ = smoke
    results = root / "results"
    sweeps = {p.name: json.loads(p.read_text()) for p in results.glob("sweep__*.json")}
    assert sorted(sweeps) == ["sweep__tiny__ar__lr0.001.json", "sweep__tiny__ar__lr0.004.json"]
    for s in sweeps.values():
        assert s["kind"] == "sweep" and s["status"] == "ok" and "diverged" in s
        assert s["settings"]["tokens"] == study.SMOKE["sweep_tokens"] and s["pretrain"]["logged_losses"]
        assert math.isfinite(s["validation_loss"]) and "perplexity" not in s and "finetune" not in s
    ok = [s for s in sweeps.values() if not s["diverged"]]
    best = min(ok, key=lambda s: s["validation_loss"])
    cell = json.loads((results / "tiny__ar__seed0.json").read_text())
    assert cell["pretrain"]["learning_rate"] == best["learning_rate"] == cell["learning_rate"]
    source = cell["pretrain"]["learning_rate_source"]
    assert sorted(r["file"] for r in source["runs"]) == sorted(sweeps)
    assert cell["pretrain"]["tokens_per_second"] > 0
    # --only_cell ran exactly one cell; the run summary records the machine and the counts
    assert [p.name for p in results.glob("tiny__*.json")] == ["tiny__ar__seed0.json"]
    summary = json.loads((results / "run__c1.json").read_text())
    assert summary["cells_ok"] == ["tiny__ar__seed0"] and summary["cells_failed"] == []
    assert summary["machine"]["gpu_count"] == 0 and summary["minutes"] > 0


def test_per_example_fields_have_consistent_lengths(smoke):
    root, _ = smoke
    cell = json.loads((root / "results" / "tiny__ar__seed0.json").read_text())
    assert cell["status"] == "ok"
    for name in study_common.HELDOUT_SETS:
        for protocol in study_common.PROTOCOLS:
            r = cell["perplexity"]["sets"][name][protocol]
            pp = r["per_passage"]
            assert {len(v) for v in pp.values()} == {r["num_passages"]}
            assert sum(pp["tokens"]) == r["num_tokens"]
            assert sum(pp["nll_sum"]) == pytest.approx(r["nll"] * r["num_tokens"], rel=1e-3)
            short = sum(b["num_tokens"] for b in r["by_prefix_length"]
                        if b["prefix_length_max"] <= study_common.SHORT_PREFIX_MAX)
            assert sum(pp["short_tokens"]) == short
    for task in study_common.TASKS:
        probe = cell["probe"][task]
        assert len(probe["test_predictions"]) == len(probe["test_labels"]) == probe["sizes"]["test"]["used"]
        ft = cell["finetune"]["full"][task]
        assert len(ft["test_predictions"]) == len(ft["test_labels"]) > 0
        assert ft["lr_grid"] == study.SMOKE["ft_lrs"] and ft["selected_on"] == "validation"
        assert ft["validation"] == max(ft["validation_by_lr"].values())
        assert ft["validation_by_lr"][f"{ft['learning_rate']:g}"] == ft["validation"]
        assert ft["test"] == pytest.approx(study_cell.score(ft["metric"], ft["test_predictions"], ft["test_labels"]),
                                           abs=1e-4, nan_ok=True)
    assert "lora" not in cell["finetune"]  # off by default


def test_resume_starts_nothing_finished(smoke, monkeypatch):
    root, common = smoke

    def no_process(*args, **kwargs):
        raise AssertionError("a finished job was started again")

    monkeypatch.setattr(study_grid.subprocess, "Popen", no_process)
    assert study.main(common + ["--sweep", "--objectives", "ar", "--sweep_lrs", "0.001", "0.004"]) == 0
    assert study.main(common + ["--only_cell", "tiny__ar__seed0"]) == 0
