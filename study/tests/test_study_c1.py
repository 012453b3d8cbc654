"""Issue 42: verdict rules that missing data cannot move, on synthetic bundles under the C1 protocol's rules."""

from __future__ import annotations

import gzip
import itertools
import json
import math
from pathlib import Path

import numpy as np
import shutil
import subprocess
import pytest

import study_curves_report as rep
import study_curves as sc
import study_data
import study_stats
from study_curves import load_protocol

HERE = Path(__file__).resolve().parent
C1_PROTOCOL = HERE.parent / "study_protocol_c1.json"
TASKS = rep.CLASSIFICATION + rep.REGRESSION
N_TEST = 400  # test examples per task


@pytest.fixture(scope="module")
def protocol():
    return load_protocol(C1_PROTOCOL)


def _entry(task, accuracy, rng):
    """A task's test predictions and labels: ``accuracy`` of them right (vader_movie: the same for every cell)."""
    if task == "vader_movie":
        y = np.linspace(-1, 1, N_TEST)
        return {"metric": "pearson", "test_labels": y.tolist(), "test_predictions": (y + 0.5 * np.cos(7 * y)).tolist()}
    labels = rng.integers(0, 2, N_TEST)
    right = int(round(accuracy * N_TEST))
    predictions = np.where(np.arange(N_TEST) < right, labels, 1 - labels)
    return {"metric": "accuracy", "test_labels": labels.tolist(), "test_predictions": predictions.tolist()}


def _cell(protocol, objective, seed, accuracy):
    """The last checkpoint's record and the fine-tuning record of one cell (fine-tuning accuracy ``accuracy``)."""
    rng = np.random.default_rng(seed)  # the same labels for every objective of a seed
    base = {"objective": objective, "seed": seed, "code_commit": "abc", "protocol_sha256": protocol["sha256"],
            "finished_unix": 1.0, "key": f"small__{objective}__seed{seed}",
            "training_slice_sha256": {"train": {"train.jsonl.gz": protocol["training_slice"]["sha256"]["train.jsonl.gz"]}}}
    tokens = protocol["checkpoint_tokens"][-1]
    probe = {t: _entry(t, 0.6, np.random.default_rng(seed)) for t in TASKS}
    checkpoint = dict(base, tokens=tokens, probe=probe)
    finetune = dict(base, kind="finetune", tokens=tokens,
                    finetune={"full": {t: _entry(t, accuracy, np.random.default_rng(seed)) for t in TASKS}})
    del rng
    return {f"{base['key']}__40M.json": checkpoint, f"{base['key']}__finetune.json": finetune}


# the fine-tuning accuracy of each objective (the base, plus a small seed-dependent wobble)
SCENARIO = {"ar": 0.70, "dar-t2": 0.75, "dar-t2-1s": 0.64}


def _records(protocol, accuracy=SCENARIO):
    out = {}
    for objective, seed in itertools.product(accuracy, protocol["seeds"]):
        out.update(_cell(protocol, objective, seed, accuracy[objective] + 0.005 * ((seed * 7 + len(objective)) % 3)))
    return out


def _bundle(path: Path, records: dict, summary: dict | None = None) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump({"records": records, **({"summary": summary} if summary else {})}, handle)
    return str(path)


def _verdicts(protocol, bundles, n_boot=200) -> dict[str, str]:
    kept, _ = rep.apply_rule(rep.merge_bundles(bundles), protocol)
    analysis = rep.analyse(rep.by_checkpoint(kept, protocol), protocol, n_boot)
    results = analysis[protocol["checkpoint_tokens"][-1]]
    rules = rep.rules_of(protocol)
    return {c: rep.verdict([r["outcome"] for r in results if r["claim"] == c], rules)
            for c in dict.fromkeys(t[0] for t in protocol["tests"]["list"])}


DEFINITE = ("holds", "does not hold", "the forms differ")


def test_a_missing_test_cannot_move_a_verdict(tmp_path, protocol):
    full = _records(protocol)
    complete = _verdicts(protocol, [_bundle(tmp_path / "full.json.gz", full)])
    assert complete == {"C1": "holds", "C1s": "does not hold", "P": "the forms differ"}
    # one cell's fine-tuning is lost: every test that needs that cell has no data
    lost = {k: v for k, v in full.items() if k != "small__dar-t2-1s__seed7__finetune.json"}
    missing = _verdicts(protocol, [_bundle(tmp_path / "lost.json.gz", lost)])
    assert missing["C1"] == "holds"  # its test has every seed: the fixed family (the lost test at p = 1) keeps it
    assert missing["C1s"] == missing["P"] == "no data"  # their one test lacks a seed: neither holds nor fails
    # whatever the lost cell would have shown, a definite verdict reached without it stays
    for accuracy in (0.30, 0.64, 0.70, 0.76, 0.95):
        filled = dict(lost, **{k: v for k, v in _cell(protocol, "dar-t2-1s", 7, accuracy).items() if "finetune" in k})
        verdicts = _verdicts(protocol, [_bundle(tmp_path / f"fill{accuracy}.json.gz", filled)])
        for claim, v in missing.items():
            if v in DEFINITE:
                assert verdicts[claim] == v, (accuracy, claim)


def test_a_claim_with_a_test_missing_never_holds_and_a_call_against_stands(tmp_path, protocol):
    better = dict(SCENARIO, **{"dar-t2-1s": 0.80})
    records = _records(protocol, better)
    assert _verdicts(protocol, [_bundle(tmp_path / "a.json.gz", records)])["C1s"] == "holds"
    lost = {k: v for k, v in records.items() if k != "small__ar__seed3__finetune.json"}
    verdicts = _verdicts(protocol, [_bundle(tmp_path / "b.json.gz", lost)])
    assert verdicts["C1s"] == verdicts["C1"] == "no data"  # never "holds" with a hole
    assert verdicts["P"] == "the forms differ"  # P does not need ar: its test is whole and called


def test_the_fixed_family_counts_a_test_without_data_as_p_one():
    assert study_stats.holm([0.01, float("nan"), 0.04]) == pytest.approx([0.02, math.nan, 0.04], nan_ok=True)
    fixed = study_stats.holm([0.01, float("nan"), 0.04], fixed_family=True)
    assert fixed == pytest.approx([0.03, math.nan, 0.08], nan_ok=True)
    # whatever p the missing test turns out to have, the others' adjusted p can only go down
    for p in (0.0, 0.005, 0.02, 0.5, 1.0):
        filled = study_stats.holm([0.01, p, 0.04])
        assert filled[0] <= fixed[0] + 1e-12 and filled[2] <= fixed[2] + 1e-12


def _result(claim, p, mean=-0.05, n=8):
    return {"claim": claim, "p": p, "n": n, "mean": mean, "null": 0.0, "expected": 1, "effect": 0.019, "sd": 0.01}


def test_issue32s_rule_let_a_missing_test_move_a_verdict_the_fixed_rule_does_not():
    # a call against at p = 0.03: alone in its family it is called; with a second test (p = 0.5) it is not
    def run(results, rules):
        rep.decide(results, rules)
        return rep.verdict([r["outcome"] for r in results], rules)

    missing = [_result("X", 0.03), dict(_result("X", float("nan"), n=0), mean=float("nan"))]
    filled = [_result("X", 0.03), _result("X", 0.5, mean=0.01)]
    assert run([dict(r) for r in missing], rep.ISSUE32_RULES) == "does not hold"
    assert run([dict(r) for r in filled], rep.ISSUE32_RULES) == "cannot tell"  # moved by the data that came later
    assert run([dict(r) for r in missing], rep.FIXED_RULES) == "cannot tell (1 of 2 without data)"
    assert run([dict(r) for r in filled], rep.FIXED_RULES) == "cannot tell"


def test_a_test_counts_only_with_every_protocol_seed(protocol):
    records = _records(protocol)
    kept, _ = rep.apply_rule({k: [v] for k, v in records.items() if "seed5__finetune" not in k or "ar" not in k},
                             protocol)
    group = rep.by_checkpoint(kept, protocol)[protocol["checkpoint_tokens"][-1]]
    test = protocol["tests"]["list"][0]
    r = rep.run_test(group, test, None, rep.protocol_seeds(protocol, "ar"))
    assert r["missing_seeds"] == [5] and math.isnan(r["p"])
    assert rep.run_test(group, test, None)["n"] == 7  # issue 32's rule would test the 7 seeds it has


def test_duplicate_tests_and_tests_of_one_quantity_are_refused(protocol):
    twice = json.loads(json.dumps(protocol))
    twice["tests"]["list"].append(list(twice["tests"]["list"][0]))
    with pytest.raises(ValueError, match="twice"):
        rep.check_no_duplicate_tests(twice)
    both = json.loads(json.dumps(protocol))
    both["tests"]["list"] += [["C2", "dar-t2", "ar", "nll_full_length", -1, 0.1, 0.0],
                              ["C2", "dar-t2", "ar", "nll_masked_prefix", -1, 0.1, 0.0]]
    with pytest.raises(ValueError, match="same quantity"):
        rep.check_no_duplicate_tests(both)
    with pytest.raises(ValueError, match="rules"):
        rep.rules_of({"tests": {"rules": {"family": "whatever finished"}}})


def test_the_report_lists_every_unfinished_cell_with_its_reason(tmp_path, protocol):
    records = {k: v for k, v in _records(protocol).items()
               if not (k.startswith("small__dar-t2__seed2__") or k == "small__ar__seed6__finetune.json")}
    summary = {"command_label": "c1p1c2", "minutes": 9.1, "minutes_limit": 9.0,
               "cells_to_run": ["small__dar-t2__seed2", "small__ar__seed6"],
               "cell_exit_codes": {"small__dar-t2__seed2": 1, "small__ar__seed6": -9},
               "unfinished_state": {"small__dar-t2__seed2": {"log_tail": ["Traceback", "RuntimeError: CUDA out of memory"]},
                                    "small__ar__seed6": {"finetune_tasks_done": {"trec": 40.0, "rotten_tomatoes": 90.0},
                                                         "log_tail": ["fine-tune vader_movie lr 0.0003"]}}}
    bundle = _bundle(tmp_path / "c1.json.gz", records, summary)
    out = tmp_path / "R.md"
    rep.build_report([bundle], out, None, C1_PROTOCOL, n_boot=50)
    text = out.read_text()
    assert ("- dar-t2/seed2: no record of the last checkpoint; last run by command c1p1c2 (9.1 of its 9.0 min); its "
            "worker failed (exit 1); log: `RuntimeError: CUDA out of memory`") in text
    assert ("- ar/seed6: no fine-tuning record; last run by command c1p1c2 (9.1 of its 9.0 min); its worker was killed "
            "at the command's limit (exit -9); fine-tuned: rotten_tomatoes, trec; log: `fine-tune vader_movie lr 0.0003`"
            ) in text
    assert "| C1 | **no data** |" in text
    # the probes: descriptive, with the seeds both sides have (every probe record is there)
    assert "| C1s | probe_classification: dar-t2-1s − ar | 40M | 8 |" in text


def test_a_record_of_another_training_slice_is_excluded(protocol):
    records = _cell(protocol, "ar", 0, 0.7)
    name = "small__ar__seed0__finetune.json"
    copies = {k: [v] for k, v in records.items()}
    copies[name] = [dict(records[name], training_slice_sha256={"train": {"train.jsonl.gz": "0" * 64}})]
    kept, excluded = rep.apply_rule(copies, protocol)
    assert name not in kept and [n for n, _ in excluded] == [name] and "another slice" in excluded[0][1]


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a", *args], check=True,
                   capture_output=True)


def test_the_device_refuses_a_tree_that_is_not_the_stamped_commit(tmp_path, protocol):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "a.py").write_text("x = 1\n")
    (repo / "b.txt").write_text("b\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "c")
    stamp = sc.preflight(tmp_path / "stamp.json", repo, C1_PROTOCOL)
    assert sorted(stamp["tree"]) == ["b.txt", "src/a.py"]
    assert sc.verify_tree(stamp, repo, required=True) == 2
    # the device has no git: a copy of the files alone passes
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    assert sc.verify_tree(stamp, copy, required=True) == 2
    (copy / "src" / "a.py").write_text("x = 2\n")
    with pytest.raises(SystemExit, match="not commit .*src/a.py"):
        sc.verify_tree(stamp, copy, required=True)
    (copy / "src" / "a.py").unlink()
    with pytest.raises(SystemExit, match="missing"):
        sc.verify_tree(stamp, copy, required=True)
    with pytest.raises(SystemExit, match="lists no files"):
        sc.verify_tree({k: v for k, v in stamp.items() if k != "tree"}, repo, required=True)
    assert sc.verify_tree({k: v for k, v in stamp.items() if k != "tree"}, repo) == 0  # issue 32's stamps


def test_throughput_counts_each_segment_once():
    seg = {"from_step": 0, "to_step": 10, "command_label": "c1", "tokens_per_second": 100.0}
    later = {"from_step": 10, "to_step": 20, "command_label": "c2", "tokens_per_second": 400.0}
    kept = {"a": {"objective": "ar", "seed": 0, "pretrain_segments": [seg]},
            "b": {"objective": "ar", "seed": 0, "pretrain_segments": [seg, later]},
            "c": {"objective": "ar", "seed": 0, "pretrain_segments": [seg, later]}}
    line = rep._throughput_lines(kept)[0]
    assert "mean 250 tokens/s over 2 distinct segments" in line  # not (100 * 3 + 400 * 2) / 5


# ---------------------------------------------------------------------------------------------
# a tiny C1 grid end to end on the CPU: a lost machine, and a resume that reruns no finished cell
# ---------------------------------------------------------------------------------------------
def _c1_command(tmp, machine, label, seeds, stamp, extra=()):
    corpus, data, bbc = study_data.write_synthetic_data(tmp / "data")
    argv = ["run", "--part", "1", "--protocol", str(C1_PROTOCOL), "--tiny", "--tiny_tokens", "1024",
            "--only_objectives", "ar", "dar-t2", "--only_seeds", *map(str, seeds), "--cells_per_gpu", "4",
            "--corpus_dir", str(corpus), "--data_root", str(data), "--bbc_dir", str(bbc), "--device", "cpu",
            "--records_dir", str(tmp / machine / "records"), "--work_dir", str(tmp / machine / "work"),
            "--bundle_dir", str(tmp / label), "--command_label", label, "--minutes", "8", "--exit_margin_s", "10",
            "--eval_minutes_guess", "0.1", "--stamp", str(stamp), "--poll_s", "0.5", *extra]
    assert sc.main(argv) == 0
    return next((tmp / label).glob("curves__part1__*.json.gz"))


def test_a_tiny_c1_grid_resumes_on_a_new_machine_without_rerunning_finished_cells(tmp_path, protocol):
    stamp = tmp_path / "stamp.json"
    tree = {p: sc.blob_sha1(sc.REPO / p) for p in ("study/study_curves.py", "study/study_protocol_c1.json")}
    stamp.write_text(json.dumps({"commit": "abc123", "dirty": False, "protocol_sha256": protocol["sha256"],
                                 "tree": tree}))
    # machine 1: seed 0 finishes (checkpoint and fine-tuning); seed 1 reaches its checkpoint, then the machine is lost
    _c1_command(tmp_path, "m1", "a1", [0], stamp)
    lost = _c1_command(tmp_path, "m1", "a2", [1], stamp, ["--no-finetune"])
    first = sc.read_bundle(lost)
    assert sorted(first["records"]) == sorted(
        f"tiny__{o}__seed{s}__{n}" for o in ("ar", "dar-t2") for s in (0, 1)
        for n in (["0.001024M.json", "finetune.json"] if s == 0 else ["0.001024M.json"]))
    assert first["summary"]["tree_checked_files"] == 2
    # machine 2 (bare): the earlier bundle's finished cells are imported, the unfinished one runs again from step 0
    resumed = sc.read_bundle(_c1_command(tmp_path, "m2", "b1", [0, 1], stamp, ["--finished_from", str(lost)]))
    summary = resumed["summary"]
    assert summary["imported_finished_cells"] == ["tiny__ar__seed0", "tiny__dar-t2__seed0"]
    assert summary["cells_to_run"] == ["tiny__ar__seed1", "tiny__dar-t2__seed1"]
    for name, record in first["records"].items():
        if "seed0" in name:
            assert resumed["records"][name] == record  # not rerun: the same record, byte for byte
        else:
            assert resumed["records"][name]["cell_run"] != record["cell_run"]  # a new run of the cell
    ft = resumed["records"]["tiny__ar__seed1__finetune.json"]
    assert ft["cell_run"] == resumed["records"]["tiny__ar__seed1__0.001024M.json"]["cell_run"]
    assert ft["versions"]["torch"] and ft["training_slice_sha256"]["train"]
    # the report: every cell counts with one run; machine 1's partial run of seed 1 is excluded and listed
    out = tmp_path / "R.md"
    result = rep.build_report([str(lost), str(next((tmp_path / "b1").glob("*.json.gz")))], out, None, C1_PROTOCOL,
                              n_boot=20, dry_run={"tokens": [1024], "objectives": ["ar", "dar-t2"], "seeds": [0, 1]})
    superseded = sorted(n for n, why in result["excluded"] if "superseded" in why)
    assert superseded == ["tiny__ar__seed1__0.001024M.json", "tiny__dar-t2__seed1__0.001024M.json"]
    c1 = next(r for r in result["analysis"][1024] if r["claim"] == "C1")
    assert c1["n"] == 2 and "missing_seeds" not in c1 and "fine-tuning at the last checkpoint" in out.read_text()


def test_the_rates_of_a_task_in_worker_processes_score_as_one_after_another(tmp_path, protocol):
    """--rate_processes only changes where a rate's seeded run happens, never its scores."""
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps({"commit": "abc123", "dirty": False, "protocol_sha256": protocol["sha256"],
                                 "tree": {"study/study_curves.py": sc.blob_sha1(sc.REPO / "study/study_curves.py")}}))
    two_rates = ["--only_objectives", "ar", "--ft_lrs", "1e-4", "3e-3"]
    one = sc.read_bundle(_c1_command(tmp_path, "m1", "seq", [0], stamp, two_rates))
    two = sc.read_bundle(_c1_command(tmp_path, "m2", "par", [0], stamp, [*two_rates, "--rate_processes", "2"]))
    name = "tiny__ar__seed0__finetune.json"
    assert (one["records"][name]["rate_processes"], two["records"][name]["rate_processes"]) == (1, 2)
    for task, entry in one["records"][name]["finetune"]["full"].items():
        other = two["records"][name]["finetune"]["full"][task]
        assert sorted(entry["validation_by_lr"]) == ["0.0001", "0.003"]
        assert other["validation_by_lr"] == entry["validation_by_lr"] and other["learning_rate"] == entry["learning_rate"]
        assert other["test_predictions"] == entry["test_predictions"] and other["test"] == entry["test"]


def test_a_draft_protocol_runs_no_cell_whose_settings_are_pending(tmp_path):
    draft = json.loads(C1_PROTOCOL.read_text())
    draft["objectives"]["dar-t2-1s"]["learning_rate"] = "pending timing run"
    draft["cells_per_gpu"] = "pending timing run"
    path = tmp_path / "draft.json"
    path.write_text(json.dumps(draft))
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps({"commit": "abc123", "dirty": False, "protocol_sha256": sc.protocol_sha256(path),
                                 "tree": {"study/study_curves.py": sc.blob_sha1(sc.REPO / "study/study_curves.py")}}))
    argv = ["run", "--part", "1", "--protocol", str(path), "--tiny", "--tiny_tokens", "1024", "--device", "cpu",
            "--only_objectives", "dar-t2-1s", "--only_seeds", "0", "--records_dir", str(tmp_path / "r"),
            "--work_dir", str(tmp_path / "w"), "--bundle_dir", str(tmp_path / "b"), "--command_label", "x",
            "--stamp", str(stamp)]
    with pytest.raises(SystemExit, match="draft.*dar-t2-1s.learning_rate.*cells_per_gpu"):
        sc.main(argv)
    stamp.write_text(json.dumps(dict(json.loads(stamp.read_text()), tree={"study/study_curves.py": "0" * 40})))
    with pytest.raises(SystemExit, match="not commit"):
        sc.main(argv)


def test_the_c1_protocol_names_the_prediction_state_and_study32_keeps_its_own():
    """Issue 42 part 3: probes and fine-tuning read the state the protocol names; issue 32's protocol, which names
    none, keeps the content stream's last layer (its numbers stay reproducible)."""
    import json
    from pathlib import Path

    from study_curves import protocol_features

    folder = Path(__file__).resolve().parents[1]
    c1 = json.loads((folder / "study_protocol_c1.json").read_text())
    assert protocol_features(c1) == "prediction_state" and c1["evaluation"]["representation"]["answers_C1"] == "fine-tuning"
    assert protocol_features(json.loads((folder / "study_protocol_curves.json").read_text())) == "content_last_layer"
