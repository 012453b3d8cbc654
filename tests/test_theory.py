"""Tests of hf_lookaround.theory: exact checks of Thm 3.1 and Thm 4.2 on enumerable toy data,
consistency of the exact plan distributions with make_plan, real text, the CLI, connectivity."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_lookaround.cli.theory import main  # noqa: E402
from hf_lookaround.objectives import make_plan  # noqa: E402
from hf_lookaround.theory import (  # noqa: E402
    check_theorem_31,
    closed_form_spectrum,
    cooccurrence_matrix,
    derived_spectrum,
    factorisation_loss,
    normalised_matrix,
    pairs_from_plan,
    plan_distribution,
    spectral_loss,
    spectrum,
    toy_cooccurrence,
    toy_dataset,
)

OBJECTIVES = [("ar", {}), ("dar", {"t": 2}), ("dar", {"t": [1, 3]}), ("mlm", {"mask_ratio": 0.4}),
              ("vmlm", {"mask_ratio_range": (0.15, 0.6)})]


def toy_spectrum(data, objective, **params):
    return spectrum(normalised_matrix(toy_cooccurrence(data, objective, **params)))


def padded(x, width):
    out = np.zeros(width)
    out[: min(len(x), width)] = x[:width]
    return out


# ---------------------------------------------------------------------------------------------
# plans: the exact distribution is the one make_plan samples from
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective,params", OBJECTIVES)
@pytest.mark.parametrize("prefix", [0, 1])
def test_plan_distribution_matches_make_plan(objective, params, prefix):
    n, draws = 6, 3000
    exact = Counter()
    for p, g, target in plan_distribution(objective, n, num_condition_tokens=prefix, **params):
        exact[(tuple(g.tolist()), tuple(target.tolist()))] += p
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)
    plan = make_plan(objective, [n] * draws, n, generator=torch.Generator().manual_seed(0),
                     num_condition_tokens=prefix, **params)
    seen = Counter(zip(map(tuple, plan.group_ids.tolist()), map(tuple, plan.is_target.tolist())))
    assert set(seen) <= set(exact), f"make_plan drew plans outside the exact support: {set(seen) - set(exact)}"
    for key, p in exact.items():  # frequencies within 5 standard errors
        assert abs(seen[key] / draws - p) <= 5 * np.sqrt(p * (1 - p) / draws) + 1e-9, key


def test_plan_distribution_rejects_bad_input():
    with pytest.raises(ValueError, match="exact enumeration"):
        plan_distribution("gvp", 6)
    with pytest.raises(ValueError, match="unknown plan parameters"):
        plan_distribution("mlm", 6, t=2)


# ---------------------------------------------------------------------------------------------
# pairs and matrices
# ---------------------------------------------------------------------------------------------
def test_pairs_from_plan_ar_and_masked():
    tokens = np.array([5, 6, 7, 8])
    ar = pairs_from_plan(tokens, np.arange(4), np.arange(4) >= 1)
    assert ar == [(((0, 5),), 6), (((0, 5), (1, 6)), 7), (((0, 5), (1, 6), (2, 7)), 8)]
    g = np.array([0, 1, 0, 1])
    masked = pairs_from_plan(tokens, g, g == 1, target_with_position=True)
    # every masked target shares one conditional text: the visible tokens with their positions
    assert masked == [(((0, 5), (2, 7)), (1, 6)), (((0, 5), (2, 7)), (3, 8))]


def test_cooccurrence_matrix_sums_duplicates_and_normalises():
    co = cooccurrence_matrix([("x", 1, 1.0), ("x", 1, 1.0), ("y", 2, 2.0)])
    assert co.contexts == ["x", "y"] and co.targets == [1, 2]
    np.testing.assert_allclose(co.matrix.toarray(), [[0.5, 0.0], [0.0, 0.5]])
    np.testing.assert_allclose(normalised_matrix(co).toarray(), np.eye(2))


def test_spectrum_methods_agree():
    m = sp.random(300, 40, density=0.05, random_state=1) + sp.eye(300, 40)
    exact = spectrum(m, method="dense")
    np.testing.assert_allclose(spectrum(m, method="gram"), exact, atol=1e-10)
    np.testing.assert_allclose(spectrum(m, method="svds", k=10), exact[:10], atol=1e-8)
    with pytest.raises(ValueError, match="method"):
        spectrum(m, method="qr")


# ---------------------------------------------------------------------------------------------
# Theorem 3.1
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective,params", OBJECTIVES)
def test_theorem_31_exact(objective, params):
    co = toy_cooccurrence(toy_dataset(3, 4, tokens_per_slot=2, shared_per_slot=1), objective, **params)
    for seed in range(3):
        res = check_theorem_31(co, dim=6, seed=seed)
        assert res["rel_diff"] < 1e-12, res
        assert res["constant"] > 1.0  # ‖Ā‖² >= σ_1² = 1: the check is not vacuous


def test_theorem_31_minimum_is_minus_top_k_energy():
    # Eckart–Young: the best rank-k F W'ᵀ is the truncated SVD, so min L = -Σ_{j<=k} σ_j²
    co = toy_cooccurrence(toy_dataset(2, 5, tokens_per_slot=2), "mlm", mask_ratio=0.4)
    abar = normalised_matrix(co).toarray()
    u, s, vt = np.linalg.svd(abar)
    k = 4
    f = (u[:, :k] * s[:k]) / np.sqrt(co.p_c)[:, None]
    g = vt[:k].T / np.sqrt(co.p_g)[:, None]
    assert spectral_loss(co, f, g) == pytest.approx(-(s[:k] ** 2).sum(), abs=1e-12)
    assert factorisation_loss(co, f, g) == pytest.approx((s[k:] ** 2).sum(), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Theorem 4.2
# ---------------------------------------------------------------------------------------------
THEOREM_42_CASES = [(2, 4, 0.5), (3, 5, 0.4), (3, 6, 0.5), (2, 6, 1 / 3), (4, 4, 0.25)]


# two tokens per slot only up to s = 5: 2**6 samples per class at s = 6 is slow and adds nothing
@pytest.mark.parametrize("r,s,rho,tokens_per_slot",
                         [(*case, 1) for case in THEOREM_42_CASES] + [(*case, 2) for case in THEOREM_42_CASES if case[1] <= 5])
def test_theorem_42_masked_matches_closed_form(r, s, rho, tokens_per_slot):
    data = toy_dataset(r, s, tokens_per_slot)
    values = toy_spectrum(data, "mlm", mask_ratio=rho)
    np.testing.assert_allclose(padded(values, r * s + 2), padded(closed_form_spectrum(r, s, "mlm", rho), r * s + 2),
                               atol=1e-10)


@pytest.mark.parametrize("r,s", [(2, 4), (3, 5), (3, 6)])
def test_theorem_42_autoregressive_has_r_fewer_ones(r, s):
    # the documented discrepancy: position 0 has no conditional text, so AR has r(s-1) ones, not rs
    values = toy_spectrum(toy_dataset(r, s), "ar")
    paper = closed_form_spectrum(r, s, "ar")
    np.testing.assert_allclose(values[: r * (s - 1)], paper[: r * (s - 1)], atol=1e-12)
    assert len(values) == r * (s - 1)
    with_bos = toy_spectrum(toy_dataset(r, s, bos="shared"), "ar")
    np.testing.assert_allclose(with_bos, np.ones(r * (s - 1) + 1), atol=1e-12)


@pytest.mark.parametrize("r,s,rho", [(2, 4, 0.5), (3, 5, 0.4), (3, 6, 2 / 3)])
def test_theorem_42_holds_in_full_with_a_class_prompt(r, s, rho):
    # a class-specific condition token gives the first target a class-revealing context: AR has rs ones
    data = toy_dataset(r, s, bos="class")
    np.testing.assert_allclose(toy_spectrum(data, "ar"), closed_form_spectrum(r, s, "ar"), atol=1e-12)
    np.testing.assert_allclose(toy_spectrum(data, "mlm", mask_ratio=rho), closed_form_spectrum(r, s, "mlm", rho),
                               atol=1e-12)


def test_theorem_42_non_integer_mask_count_uses_effective_ratio():
    r, s, rho = 2, 5, 0.3  # masked_plan masks round(1.5) = 2 tokens: ρ = 0.4 in effect
    values = toy_spectrum(toy_dataset(r, s), "mlm", mask_ratio=rho)
    np.testing.assert_allclose(values, closed_form_spectrum(r, s, "mlm", 0.4), atol=1e-12)
    np.testing.assert_allclose(values, derived_spectrum(r, s, "mlm", rho), atol=1e-12)
    assert abs(values[r] - closed_form_spectrum(r, s, "mlm", rho)[r]) > 0.05


def test_theorem_42_fails_when_classes_share_tokens():
    # adjacent classes share a token in every slot: the r class blocks merge. AR keeps one block per
    # target position (it never links targets at different positions): s-1 ones; masked links all: 1
    r, s = 3, 4
    data = toy_dataset(r, s, tokens_per_slot=2, shared_per_slot=1)
    ar = toy_spectrum(data, "ar")
    masked = toy_spectrum(data, "mlm", mask_ratio=0.5)
    assert np.sum(ar > 1 - 1e-9) == s - 1 and ar[s - 1] < 0.5
    assert np.sum(masked > 1 - 1e-9) == 1 and masked[1] < 0.6


def test_tails_shrink_with_mask_ratio_and_dar_lies_between_at_r_plus_one():
    r, s = 3, 6
    data = toy_dataset(r, s)
    tails = [toy_spectrum(data, "mlm", mask_ratio=rho)[r] for rho in (1 / 6, 2 / 6, 3 / 6, 4 / 6)]
    assert all(a > b for a, b in zip(tails, tails[1:])), tails
    ar = toy_spectrum(data, "ar")[r]
    dar = toy_spectrum(data, "dar", t=2)[r]
    masked = toy_spectrum(data, "mlm", mask_ratio=0.5)[r]
    assert masked < dar < ar, (masked, dar, ar)


# ---------------------------------------------------------------------------------------------
# real text
# ---------------------------------------------------------------------------------------------
def test_real_text_spectra_and_bucketing(bbc_text_dir):
    from hf_lookaround.theory.text import build_tokenizer, load_texts, sampled_cooccurrence, token_windows

    texts = load_texts(bbc_text_dir / "train.jsonl.gz", max_documents=30)  # about 12,000 words
    windows = token_windows(texts, build_tokenizer("words", texts, 300), 16, 400, seed=0)
    assert windows.shape == (400, 16)
    ar = sampled_cooccurrence(windows, "ar")
    # almost every AR prefix is unique: Ā is (nearly) a partial permutation, its spectrum flat at 1
    assert ar.shape[0] > 0.9 * 400 * 15
    assert spectrum(normalised_matrix(ar))[50] == pytest.approx(1.0)
    masked = spectrum(normalised_matrix(sampled_cooccurrence(windows, "mlm", mask_ratio=0.3)))
    assert masked[10] < 0.9  # one masked context links several targets
    hashed = sampled_cooccurrence(windows, "ar", buckets=256)
    assert hashed.shape[0] <= 256 and spectrum(normalised_matrix(hashed))[1] < 0.9
    local = sampled_cooccurrence(windows, "ar", context="window:1")
    assert local.shape[0] < ar.shape[0] / 5  # one-token contexts recur across the corpus


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def test_cli_theorems(tmp_path, capsys):
    assert main(["thm31", "--r", "2", "--s", "4", "--objectives", "ar", "mlm:0.5", "--seeds", "1"]) == 0
    out = tmp_path / "thm42.md"
    assert main(["thm42", "--r", "2", "--s", "4", "--rho", "0.5", "--output", str(out)]) == 0
    table = out.read_text()
    assert "| 2 | 4 | 0.5000 | 2 | mlm | 1.000000 | 0.577350 | 0.577350 | 0.000000 | yes | yes |" in table
    assert "| 2 | 4 | 0.5000 | - | ar | 1.000000 | 1.000000 | **0.000000** (1.000000) | 0.000000 | no: r(s-1) < j <= rs | - |" in table
    plot = tmp_path / "tails.png"
    assert main(["tails", "--r", "2", "--s", "4", "--objectives", "ar", "mlm:0.5", "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 1000
    assert main(["thm31", "--objectives", "mlm:1.5"]) == 2
    assert "error" in capsys.readouterr().out


def test_cli_spectrum_on_a_text_file(tmp_path):
    data = tmp_path / "docs.txt"
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(30)]
    data.write_text("\n".join(" ".join(rng.choice(words, 200)) for _ in range(5)))
    out = tmp_path / "spec.json"
    code = main(["spectrum", "--data", str(data), "--seq-len", "8", "--num-windows", "100", "--vocab-size", "40",
                 "--objectives", "ar", "mlm:0.25", "--contexts", "full", "window:1@64", "--report", "2", "5",
                 "--json", str(out), "--plot", str(tmp_path / "spec.png")])
    assert code == 0
    import json

    spectra = json.loads(out.read_text())
    assert set(spectra) == {"ar [full]", "mlm:0.25 [full]", "ar [window:1@64]", "mlm:0.25 [window:1@64]"}
    assert max(spectra["ar [full]"]) == pytest.approx(1.0)
    assert main(["spectrum", "--data", str(tmp_path / "missing.txt")]) == 2


# ---------------------------------------------------------------------------------------------
# connectivity (paper (a) Fig. 2 surrogate) on tiny random LookAround checkpoints
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    from hf_lookaround import LookAroundConfig, LookAroundModel
    from hf_lookaround.data.tokenization import train_tokenizer

    texts = [f"sample {i} of the text about topic {i % 3}" for i in range(60)]
    paths = {}
    for name, attention in [("ar", "causal"), ("mlm", "bidirectional")]:
        path = tmp_path_factory.mktemp(name)
        tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1, output_dir=str(path))
        torch.manual_seed(0)
        config = LookAroundConfig.from_preset("tiny", vocab_size=len(tokenizer), default_attention=attention,
                                              max_position_embeddings=64)
        LookAroundModel(config).save_pretrained(path)
        paths[name] = str(path)
    return paths, texts


def test_connectivity_features_and_plot(tiny_checkpoints, tmp_path):
    from hf_lookaround.theory.connectivity import mean_pooled_features, plot_connectivity, top_pair_products

    paths, texts = tiny_checkpoints
    feats = mean_pooled_features(paths["mlm"], texts[:12], max_length=32, batch_size=5)
    assert feats.shape == (12, 64) and np.isfinite(feats).all()
    # mean pooling ignores padding: a text alone gives the features it gets inside a padded batch
    alone = mean_pooled_features(paths["mlm"], [texts[0]], max_length=32)
    np.testing.assert_allclose(alone[0], feats[0], atol=1e-4)
    top = top_pair_products(feats, top=20)
    assert top.shape == (20,) and np.all(np.diff(top) <= 0) and top[0] <= 1 + 1e-9
    x = feats.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    all_pairs = np.sort((x @ x.T)[np.triu_indices(12, 1)])[::-1]
    np.testing.assert_allclose(top, all_pairs[:20], atol=1e-12)
    out = plot_connectivity({"mlm": top, "other": top - 0.1}, tmp_path / "conn.png")
    assert out.stat().st_size > 1000


def test_cli_connectivity(tiny_checkpoints, tmp_path):
    paths, texts = tiny_checkpoints
    data = tmp_path / "held_out.txt"
    data.write_text(" ".join(texts[:20]))  # one long document, cut into samples of 6 words
    plot = tmp_path / "fig2.png"
    code = main(["connectivity", "--models", f"AR={paths['ar']}", f"MLM={paths['mlm']}", "--data", str(data),
                 "--chunk-words", "6", "--num-samples", "15", "--top", "50", "--plot", str(plot),
                 "--json", str(tmp_path / "c.json")])
    assert code == 0 and plot.exists()
    import json

    top = json.loads((tmp_path / "c.json").read_text())
    assert set(top) == {"AR", "MLM"} and len(top["AR"]) == 50  # 15 samples -> 105 pairs, top 50 kept
