"""``perplexity --protocol elbo``: the Monte-Carlo negative ELBO of a diffusion checkpoint (mdlm, bd3lm) against
the exact expectation over every time and mask of a short sequence, and the command line's report."""

import itertools
import json

import numpy as np
import pytest
import torch
from scipy import integrate

import hf_lookaround as H
from hf_lookaround.cli import main as cli_main
from hf_lookaround.evaluation.perplexity import elbo_window_nlls
from hf_lookaround.objectives.mdlm import DEFAULT_EPS
from conftest import BOS, PAD

EPS = DEFAULT_EPS


def weight_integral(k: int, n: int) -> float:
    """E_t[(1 / t) t^k (1 - t)^(n - k)] for t ~ U(eps, 1]: a mask of k of n tokens, weighted by the linear
    schedule's 1 / t."""
    return integrate.quad(lambda t: t ** (k - 1) * (1 - t) ** (n - k), EPS, 1.0, epsabs=1e-12)[0] / (1 - EPS)


def masked_nll(model, ids, group_ids, masked) -> float:
    """The summed NLL of the ``masked`` positions, predicted by the query stream with these ranks."""
    positions = torch.tensor([masked])
    logits = model(input_ids=ids, group_ids=group_ids, target_positions=positions).logits
    return float(-torch.log_softmax(logits, -1)[0, torch.arange(len(masked)), ids[0, masked]].sum())


def exact_negative_elbo(model, ids, block: int) -> float:
    """The negative ELBO per token, exactly: blocks of ``block`` tokens after BOS (``block`` = the length: MDLM);
    a masked token of block k sees the earlier blocks and the unmasked tokens of its own, so block k's terms are
    a sum over its own masks only, each weighted by the probability of the mask under its block's time."""
    n = ids.shape[1] - 1
    total = 0.0
    for start in range(1, n + 1, block):
        members = list(range(start, min(start + block, n + 1)))
        for k in range(1, len(members) + 1):
            for masked in itertools.combinations(members, k):
                # BOS 0; every block's tokens 1 + 2 * (its index), the masked ones one more
                g = torch.tensor([[0] + [1 + 2 * ((i - 1) // block) + (i in masked) for i in range(1, n + 1)]])
                total += masked_nll(model, ids, g, list(masked)) * weight_integral(k, len(members))
    return total / n


@pytest.mark.parametrize("objective,params,block", [
    ("mdlm", {"noise_schedule": "linear", "eps": EPS, "low_discrepancy": True}, None),
    ("mdlm", {"noise_schedule": "linear", "eps": EPS, "low_discrepancy": False}, None),
    ("bd3lm", {"diffusion_block": 3, "noise_schedule": "linear", "eps": EPS, "low_discrepancy": True,
               "noise_clip": [0.3, 0.8]}, 3),  # the training clip does not change the ELBO's times
])
def test_the_monte_carlo_elbo_matches_the_exact_enumeration(objective, params, block, tiny_model):
    model = tiny_model(H.LookAroundForPreTraining, seed=1)
    model.config.objective, model.config.plan_params = objective, params
    ids = torch.tensor([[BOS, 17, 5, 42, 9, 33, 21]])
    n = ids.shape[1] - 1
    with torch.no_grad():
        exact = exact_negative_elbo(model, ids, block or n)
        rows = 400
        totals = elbo_window_nlls(model, ids.repeat(rows, 1).tolist(), 1, 4, torch.Generator().manual_seed(0), PAD)
    samples = totals.reshape(-1) / n
    estimate, error = samples.mean(), samples.std(ddof=1) / np.sqrt(samples.size)
    assert abs(estimate - exact) < 4 * error, (estimate, exact, error)
    assert error < 0.05 * exact  # the test can tell a wrong weight (e.g. 1 instead of 1 / t) from the right one


def test_the_command_reports_samples_and_standard_error(tiny_model, tokenizer_dir, bbc_text_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(H.LookAroundForPreTraining, vocab_size=len(tokenizer))
    model.config.objective, model.config.plan_params = "bd3lm", {"diffusion_block": 4}
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    args = ["perplexity", "--model_name_or_path", str(tmp_path / "ckpt"), "--dataset", str(bbc_text_dir),
            "--protocol", "elbo", "--max_length", "32", "--max_documents", "2", "--num_samples", "3",
            "--output_dir", str(out), "--device", "cpu"]
    assert cli_main(args) == 0
    report = json.loads((out / "perplexity.json").read_text())
    assert report["protocol"] == "elbo" and report["num_samples"] == 3 and report["standard_error"] > 0
    assert report["elbo_perplexity"] == pytest.approx(np.exp(report["nll_per_token"]))
    low, high = report["perplexity_interval"]
    assert low < report["elbo_perplexity"] < high
    table = (out / "perplexity_elbo.md").read_text()
    assert "standard error" in table and "| 3 |" in table
    # seeded: the same command gives the same number
    assert cli_main(args[:-4] + ["--output_dir", str(tmp_path / "again"), "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "again" / "perplexity.json").read_text())["nll_per_token"] == report["nll_per_token"]
    # a checkpoint that predicts no masked tokens (here dar) is refused in one line
    model.config.objective, model.config.plan_params = "dar", {"t": 2}
    model.save_pretrained(tmp_path / "dar")
    tokenizer.save_pretrained(tmp_path / "dar")
    assert cli_main(["perplexity", "--model_name_or_path", str(tmp_path / "dar"), "--dataset", str(bbc_text_dir),
                  "--protocol", "elbo", "--max_length", "32", "--max_documents", "1", "--output_dir",
                  str(tmp_path / "x"), "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "needs a checkpoint trained with a diffusion objective" in err and "or a masked one" in err


@pytest.mark.parametrize("objective,params", [("mlm", {"mask_ratio": 0.15}), ("vmlm", {}),
                                              ("mixture", {"mixture": {"mlm": 0.5, "vmlm": 0.5}})])
def test_a_masked_checkpoint_is_scored_by_mdlms_bound(objective, params, tiny_model, tokenizer_dir, bbc_text_dir,
                                                      tmp_path):
    """A masked checkpoint (no diffusion objective) takes `--protocol elbo`: MDLM's bound with its default schedule,
    the same number as the same weights recorded as an mdlm checkpoint with mdlm's defaults, and unlike the bound
    with another schedule (so the equality is not a constant)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(H.LookAroundForPreTraining, vocab_size=len(tokenizer))

    def run(name, objective, params):
        model.config.objective, model.config.plan_params = objective, params
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        assert cli_main(["perplexity", "--model_name_or_path", str(tmp_path / name), "--dataset", str(bbc_text_dir),
                         "--protocol", "elbo", "--max_length", "32", "--max_documents", "1", "--num_samples", "3",
                         "--output_dir", str(tmp_path / f"out-{name}"), "--device", "cpu"]) == 0
        return json.loads((tmp_path / f"out-{name}" / "perplexity.json").read_text())

    masked, mdlm = run("masked", objective, params), run("mdlm", "mdlm", {})
    cosine = run("cosine", "mdlm", {"noise_schedule": "cosine"})
    assert masked["elbo_objective"] == "mdlm" and masked["objective"] == objective
    assert masked["nll_per_token"] == mdlm["nll_per_token"]
    assert masked["standard_error"] == mdlm["standard_error"]
    assert masked["nll_per_token"] != cosine["nll_per_token"]


def test_the_command_scores_a_mixture_by_its_diffusion_components_bound(tiny_model, tokenizer_dir, bbc_text_dir,
                                                                         tmp_path, capsys):
    """`perplexity --protocol elbo` on an mdlm + vmlm mixture is the ELBO of its mdlm component with that component's
    parameters: the same number as the same weights recorded as an mdlm checkpoint with those parameters, another
    than with mdlm's defaults. A mixture of two diffusion objectives is refused in one line."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(H.LookAroundForPreTraining, vocab_size=len(tokenizer))
    component = {"noise_schedule": "cosine", "eps": 0.05, "low_discrepancy": False}
    configs = {
        "mixture": ("mixture", {"mixture": {"mdlm": 0.5, "vmlm": 0.5}, "components": {"mdlm": component, "vmlm": {}}}),
        "mdlm": ("mdlm", component),
        "mdlm-defaults": ("mdlm", {}),
        "two": ("mixture", {"mixture": {"mdlm": 0.5, "bd3lm": 0.5}, "components": {"bd3lm": {"diffusion_block": 4}}}),
    }

    def run(name):
        model.config.objective, model.config.plan_params = configs[name]
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        code = cli_main(["perplexity", "--model_name_or_path", str(tmp_path / name), "--dataset", str(bbc_text_dir),
                         "--protocol", "elbo", "--max_length", "32", "--max_documents", "1", "--num_samples", "3",
                         "--output_dir", str(tmp_path / f"out-{name}"), "--device", "cpu"])
        return json.loads((tmp_path / f"out-{name}" / "perplexity.json").read_text()) if code == 0 else None

    mixture, mdlm = run("mixture"), run("mdlm")
    assert (mixture["objective"], mixture["elbo_objective"]) == ("mixture", "mdlm")
    assert mixture["nll_per_token"] == mdlm["nll_per_token"] and mixture["standard_error"] == mdlm["standard_error"]
    assert mixture["nll_per_token"] != pytest.approx(run("mdlm-defaults")["nll_per_token"], rel=1e-3)
    capsys.readouterr()
    assert run("two") is None
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "this mixture has 2 diffusion components ['bd3lm', 'mdlm']" in err and "--protocol" in err
