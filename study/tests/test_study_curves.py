"""The learning curves of the study (issue 32): protocol and commit stamp, the balanced assignment, the rule for
failed cells, the clustered bootstrap, and two consecutive CPU "commands" of a miniature part (the second resumes
the first's cells; its bundle holds every record)."""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import study_curves as sc
import study_curves_report as rep
import study_data

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def protocol():
    return sc.load_protocol()


def test_every_gpu_runs_every_objective_equally_often(protocol):
    for part in ("1", "2"):
        cells = sc.part_cells(protocol, part)
        for gpus in (["0", "1", "2", "3"], ["0", "1"]):
            placed = sc.latin_square(cells, gpus)
            per_gpu = Counter((o, g) for (o, _), g in placed.items())
            objectives = {o for o, _ in cells}
            counts = {per_gpu[(o, g)] for o in objectives for g in gpus}
            assert len(counts) == 1 and counts.pop() == 4 // len(gpus)
    assert len(sc.part_cells(protocol, "2", with_optional=True)) == 28 + 8


def test_parts_are_disjoint_complete_cells_and_checkpoint_steps(protocol):
    one, two = set(sc.part_cells(protocol, "1")), set(sc.part_cells(protocol, "2"))
    assert not one & two and len(one | two) == 7 * 8
    assert sc.checkpoint_steps(protocol) == [611, 1221, 2442]
    assert all(o in protocol["objectives"] for t in protocol["tests"]["list"] for o in t[1:3])


def _repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("x")
    for cmd in (["add", "f"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "c"]):
        subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True)
    return tmp_path


def test_preflight_refuses_a_dirty_tree_and_the_device_refuses_a_bad_stamp(tmp_path, protocol):
    repo = _repo(tmp_path / "repo")
    stamp_path = tmp_path / "stamp" / "code_commit.json"
    (repo / "untracked").write_text("travels with the tree")
    with pytest.raises(SystemExit, match="dirty"):
        sc.preflight(stamp_path, repo)
    assert not stamp_path.exists()
    (repo / "untracked").unlink()
    stamp = sc.preflight(stamp_path, repo)
    assert stamp["commit"] == sc.git_state(repo)[0] and sc.read_stamp(protocol, stamp_path)["dirty"] is False
    with pytest.raises(SystemExit, match="no commit stamp"):
        sc.read_stamp(protocol, tmp_path / "missing.json")
    stamp_path.write_text(json.dumps(dict(stamp, commit=stamp["commit"] + "+dirty")))
    with pytest.raises(SystemExit, match="dirty"):
        sc.read_stamp(protocol, stamp_path)
    stamp_path.write_text(json.dumps(dict(stamp, protocol_sha256="0" * 64)))
    with pytest.raises(SystemExit, match="another|protocol"):
        sc.read_stamp(protocol, stamp_path)
    with pytest.raises(SystemExit, match="no protocol"):
        sc.load_protocol(tmp_path / "none.json")


def _record(objective, seed, tokens, protocol, probe=0.5, **extra):
    entry = {"metric": "accuracy", "test_predictions": [1, 0, 1, 1], "test_labels": [1, 0, 0, 1]}
    probe_entries = {t: dict(entry, test_predictions=[1, 0, 1, int(probe > 0.6)]) for t in rep.CLASSIFICATION}
    probe_entries["vader_movie"] = {"metric": "pearson", "test_predictions": [0.1, 0.5, 0.2, 0.9],
                                    "test_labels": [0.0, 0.4, 0.3, 1.0]}
    r = {"key": f"small__{objective}__seed{seed}", "objective": objective, "seed": seed, "tokens": tokens,
         "code_commit": "abc", "protocol_sha256": protocol["sha256"], "finished_unix": 1.0, "probe": probe_entries,
         "perplexity_documents": {n: [0, 0, 1] for n in rep.SETS}}
    r.update(extra)
    return r


def test_the_rule_excludes_and_lists_records(protocol):
    t = protocol["checkpoint_tokens"][0]
    good = _record("ar", 0, t, protocol)
    copies = {"a.json": [good], "b.json": [dict(good, protocol_sha256="x")],
              "c.json": [dict(good, code_commit="abc+dirty")],
              "d.json": [dict(good, probe={"x": {"v": float("nan")}})],
              "e.json": [dict(good, finished_unix=5.0, command_label="late"), dict(good, finished_unix=2.0)]}
    kept, excluded = rep.apply_rule(copies, protocol)
    assert sorted(kept) == ["a.json", "e.json"] and kept["e.json"]["finished_unix"] == 2.0
    assert [n for n, _ in excluded] == ["b.json", "c.json", "d.json", "e.json"]


def test_a_test_uses_the_seeds_complete_on_both_sides(protocol):
    t = protocol["checkpoint_tokens"][0]
    group = {"mlm-0.15": {s: _record("mlm-0.15", s, t, protocol, probe=0.7) for s in (0, 1, 2)},
             "ar": {s: _record("ar", s, t, protocol) for s in (1, 2, 3)}}
    test = ["C4", "mlm-0.15", "ar", "probe_classification", 1, 0.019, 0.0]
    r = rep.run_test(group, test, None)
    assert r["seeds"] == [1, 2] and r["n"] == 2 and r["mean"] == pytest.approx(0.25)
    assert rep.run_test(group, ["C4", "mlm-0.15", "ar", "finetune_average", 1, 0.019, 0.0], None)["n"] == 0


def test_the_bootstrap_resamples_whole_documents():
    w = rep.cluster_weights([0, 0, 0, 1, 2, 2], n_boot=50, seed=0)
    assert w.shape == (50, 6)
    assert (w[:, 0] == w[:, 1]).all() and (w[:, 1] == w[:, 2]).all() and (w[:, 4] == w[:, 5]).all()
    assert (w[:, [0, 3, 4]].sum(axis=1) == 3).all()  # 3 documents drawn per replicate
    assert not (w[:, 0] == w[:, 3]).all()


def test_verdicts_and_direction(protocol):
    assert rep.verdict(["supports", "supports"]) == "holds"
    assert rep.verdict(["supports", "contradicts"]) == "does not hold"
    assert rep.verdict(["no data"]) == "no data"
    assert rep.verdict(["not called", "differs"]) == "the forms differ"  # P: two-sided, no predicted direction
    assert rep.verdict(["not called", "no data"]) == "cannot tell"
    series = [{"outcome": "supports", "n": 8, "mean": 0.1, "null": 0.0},
              {"outcome": "contradicts", "n": 8, "mean": -0.1, "null": 0.0}]
    assert rep.direction_changes(series) == "yes (called both ways)"
    series[1]["outcome"] = "not called"
    assert rep.direction_changes(series).startswith("sign only")


# ---------------------------------------------------------------------------------------------
# two consecutive commands of a miniature part on the CPU (the device-side entry point)
# ---------------------------------------------------------------------------------------------
def _command(tmp, label, minutes, margin, stamp, eval_guess, extra=()):
    corpus, data, bbc = study_data.write_synthetic_data(tmp / "data")
    argv = ["run", "--part", "1", "--tiny", "--only_objectives", "ar", "--only_seeds", "0", "1", "--cells_per_gpu", "2",
            "--corpus_dir", str(corpus), "--data_root", str(data), "--bbc_dir", str(bbc), "--device", "cpu",
            "--records_dir", str(tmp / "records"), "--work_dir", str(tmp / "work"), "--bundle_dir", str(tmp / label),
            "--command_label", label, "--minutes", str(minutes), "--exit_margin_s", str(margin),
            "--eval_minutes_guess", str(eval_guess), "--tiny_tokens", "1024", "40960", "--stamp", str(stamp), "--poll_s", "0.5",
            *extra]
    assert sc.main(argv) == 0
    return sc.read_bundle(next((tmp / label).glob("curves__part1__*.json.gz")))


def test_a_second_command_resumes_the_first_commands_cells(tmp_path, protocol):
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps({"commit": "abc123", "dirty": False, "protocol_sha256": protocol["sha256"]}))
    # c1: every cell takes one step and leaves as at a deadline (a stop that does not depend on the machine's
    # speed): a resumable checkpoint, no record
    first = _command(tmp_path, "c1", minutes=4.0, margin=10.0, stamp=stamp, eval_guess=1.0,
                     extra=("--steps_this_command", "1"))
    assert first["records"] == {}
    # the bundle says what each unfinished cell left on the machine's disk (which goes back with the machine)
    state = first["summary"]["unfinished_state"]
    assert sorted(state) == ["tiny__ar__seed0", "tiny__ar__seed1"]
    assert all(s["log_tail"] and "pretrained steps" in "\n".join(s["log_tail"]) for s in state.values())
    assert first["summary"]["cell_exit_codes"] == {"tiny__ar__seed0": 0, "tiny__ar__seed1": 0}
    second = _command(tmp_path, "c2", minutes=4.0, margin=10.0, stamp=stamp, eval_guess=0.2)
    expected = [f"tiny__ar__seed{s}__{sc.tokens_tag(t)}.json" for s in (0, 1) for t in (1024, 40960)]
    assert sorted(second["records"]) == sorted(expected + [f"tiny__ar__seed{s}__finetune.json" for s in (0, 1)])
    last = second["records"]["tiny__ar__seed0__0.04096M.json"]
    segments = last["pretrain_segments"]
    assert [s["command_label"] for s in segments][0] == "c1" and segments[-1]["command_label"] == "c2"
    assert segments[-1]["resumed"] and segments[-1]["from_step"] == segments[-2]["to_step"] >= 2
    assert segments[0]["command_label"] == "c1" and segments[0]["to_step"] == 1 and segments[1]["resumed"]
    assert segments[-1]["to_step"] == 80
    assert last["code_commit"] == "abc123" and last["protocol_sha256"] == protocol["sha256"]
    assert second["summary"]["cells_unfinished"] == []
    ft = second["records"]["tiny__ar__seed0__finetune.json"]["finetune"]["full"]
    assert set(ft) == {"rotten_tomatoes", "trec", "vader_movie", "sms_spam"}
    sets = last["perplexity"]["sets"]["gutenberg"]
    assert "full_length" in sets and math.isclose(sets["full_length"]["nll"], sets["masked_prefix"]["nll"], rel_tol=1e-3)
    assert np.asarray(last["perplexity_documents"]["gutenberg"]).size == sets["masked_prefix"]["num_passages"]


def test_study32s_results_md_is_the_report_of_the_committed_bundles(tmp_path):
    # docs/results/study32/RESULTS.md is generated: the committed bundles of both parts give it byte for byte (plot
    # links included; docs/RESULTS.md is issue 42's C1 report since, tested in test_study_c1.py)
    study = ROOT / "docs" / "results" / "study32"
    bundles = sorted(str(p) for p in study.glob("curves__part*.json.gz"))
    assert [Path(b).name for b in bundles] == ["curves__part1__p1c3.json.gz", "curves__part2__p2c4.json.gz"]
    out = tmp_path / "docs" / "results" / "study32" / "RESULTS.md"
    rep.build_report(bundles, out, tmp_path / "docs" / "results" / "study32")
    assert out.read_text(encoding="utf-8") == (study / "RESULTS.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("objective", ["ar", "dar-t2-1s"])
def test_the_second_scorer_scores_every_checkpoint_with_lm_eval_and_agrees(tmp_path, protocol, objective):
    """--second_scorer lm_eval: lm-evaluation-harness scores the AR protocol's held-out passages of each checkpoint
    (rolling log-likelihood, local tasks written into the cell folder) and the record holds its totals beside
    ar_perplexity's on the same passages and windows; they agree within 0.3 %."""
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps({"commit": "abc123", "dirty": False, "protocol_sha256": protocol["sha256"]}))
    corpus, data, bbc = study_data.write_synthetic_data(tmp_path / "data")
    argv = ["run", "--part", "1", "--tiny", "--only_objectives", objective, "--only_seeds", "0",
            "--corpus_dir", str(corpus), "--data_root", str(data), "--bbc_dir", str(bbc), "--device", "cpu",
            "--records_dir", str(tmp_path / "records"),
            "--work_dir", str(tmp_path / "work"), "--bundle_dir", str(tmp_path / "out"), "--command_label", "c1",
            "--minutes", "4", "--exit_margin_s", "10", "--eval_minutes_guess", "0.2", "--tiny_tokens", "1024",
            "--stamp", str(stamp), "--poll_s", "0.5", "--no-finetune", "--second_scorer", "lm_eval"]
    assert sc.main(argv) == 0
    bundle = sc.read_bundle(next((tmp_path / "out").glob("curves__part1__*.json.gz")))
    record = bundle["records"][f"tiny__{objective}__seed0__0.001024M.json"]
    second = record["second_scorer"]
    assert second["scorer"] == "lm_eval" and "skipped" not in second
    assert set(second["sets"]) == set(rep.SETS)
    for entry in second["sets"].values():
        harness, package = entry["harness"], entry["package"]
        assert harness["num_words"] > 0 and harness["num_bytes"] == package["num_bytes"] > 0
        assert harness["nll"] == pytest.approx(package["nll"], rel=3e-3) and entry["agrees"] is True
        assert harness["bits_per_byte"] == pytest.approx(package["bits_per_byte"], rel=3e-3)
        assert entry["relative_difference"] <= 3e-3
    # the same windows on both sides: the package's windows are the block the cell trained on, and some passage
    # needs more than one
    assert second["package_windows"] == {"max_length": 64, "stride": 63} and second["max_length"] == 63
    passages = sum(record["perplexity"]["sets"][n]["ar_plan"]["num_passages"] for n in rep.SETS)
    assert sum(e["package"]["num_windows"] for e in second["sets"].values()) > passages
    assert second["agrees"] is True and second["max_relative_difference"] <= 3e-3
    # the task files a user can rerun with `lm_eval --include_path`
    tasks = tmp_path / "work" / "cells" / f"tiny__{objective}__seed0" / "second_scorer" / "tasks"
    assert sorted(p.name for p in tasks.glob("*.yaml")) == sorted(f"curves_heldout_{n}.yaml" for n in rep.SETS)
    # the report's table of the second scorer's agreement
    report = tmp_path / "RESULTS.md"
    rep.build_report([str(next((tmp_path / "out").glob("*.json.gz")))], report, None, n_boot=10,
                     dry_run={"tokens": [1024], "objectives": [objective], "seeds": [0]})
    text = report.read_text(encoding="utf-8")
    assert "## The second scorer (lm-evaluation-harness)" in text and "at most 0.3%" in text
    assert f"| {objective}/seed0 | 1 of 1 | {second['max_relative_difference']:.1e} | 0 |" in text


def test_the_report_lists_skipped_and_disagreeing_second_scorer_entries(protocol):
    t = protocol["checkpoint_tokens"]
    agreeing = {"sets": {n: {"relative_difference": 1e-6, "agrees": True} for n in rep.SETS}, "agreement": 3e-3}
    off = dict(agreeing, sets=dict(agreeing["sets"], bbc={"relative_difference": 0.01, "agrees": False}))
    skipped = {"skipped": "no next-token view yet: dar's one-stream form ...", "agreement": 3e-3}
    kept = {"a": _record("ar", 0, t[0], protocol, second_scorer=agreeing),
            "b": _record("ar", 0, t[1], protocol, second_scorer=off),
            "c": _record("dar-t2-1s", 1, t[0], protocol, second_scorer=skipped),
            "d": _record("mlm-0.15", 0, t[0], protocol)}
    lines = rep._second_scorer_lines(protocol, kept)
    assert lines[-3:] == ["| ar/seed0 | 2 of 2 | 1.0e-02 | 1 |",
                          "| dar-t2-1s/seed1 | 0 of 1 (skipped 1: no next-token view yet) | – | – |", ""]
    assert rep._second_scorer_lines(protocol, {"d": kept["d"]}) == []
