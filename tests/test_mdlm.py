"""``mdlm``: masked diffusion (MDLM) as a masked-family objective in one module: the draw, the weights that make the
loss the negative ELBO per token, both forms, mixtures and the command line (the leak audit and the collator
battery: test_objective_collators.py; the ELBO protocol: test_elbo.py)."""

import json

import numpy as np
import pytest
import torch
from scipy import stats

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.cli import main as cli_main
from hf_lookaround.objectives import mdlm, mixture
from hf_lookaround.training.pretraining import ObjectiveArguments
from conftest import BOS, EOS, MASK, TINY_TEXT, ToyTokenizer

VOCAB = TINY_TEXT["vocab_size"]
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


def docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": [BOS] + torch.randint(4, VOCAB, (n - 2,), generator=g).tolist() + [EOS]} for n in lengths]


def times_of(plan, lengths, prefix=1):
    """Each row's time, read back from the per-row ELBO weights ``1 / (t n)`` (linear schedule)."""
    n = torch.as_tensor(lengths) - prefix
    w = plan.loss_weights.max(1).values.double()
    return torch.where(w > 0, 1.0 / (w * n), torch.nan)


# ---------------------------------------------------------------------------------------------
# the draw
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("low_discrepancy", [True, False])
def test_each_token_is_masked_with_probability_t_and_times_are_uniform(low_discrepancy):
    rows, n = 400, 64
    lengths = [n + 1] * rows
    plan = mdlm.elbo_plan(lengths, n + 1, low_discrepancy=low_discrepancy, num_condition_tokens=1,
                          generator=torch.Generator().manual_seed(0))
    t = times_of(plan, lengths)
    counts = plan.is_target.sum(1).double()
    # the masked count of a row is Binomial(n, t): standardised, mean 0 and variance 1 (rows with t > 0.2, whose
    # time the weights always show: a row with nothing masked has no weight to read it from)
    seen = t > 0.2
    assert seen.sum() > 0.7 * rows
    z = (counts[seen] - n * t[seen]) / torch.sqrt(n * t[seen] * (1 - t[seen]))
    assert abs(float(z.mean())) < 4 / rows ** 0.5 and 0.8 < float(z.var()) < 1.2
    # the times: U(eps, 1]; low discrepancy: one time in each of the batch's strata, where independent times leave
    # some strata empty
    times = mdlm.draw_times(np.random.default_rng(0), rows, mdlm.DEFAULT_EPS, low_discrepancy)
    assert times.min() > mdlm.DEFAULT_EPS and times.max() <= 1.0
    assert stats.kstest(times, stats.uniform(mdlm.DEFAULT_EPS, 1 - mdlm.DEFAULT_EPS).cdf).pvalue > 1e-3
    u = (1.0 - times) / (1.0 - mdlm.DEFAULT_EPS)  # strata of (eps, 1]
    strata = np.bincount(np.minimum((u * rows).astype(int), rows - 1), minlength=rows)
    assert (strata.max() <= 1) == low_discrepancy
    # BOS is never masked, and ranks are mlm's: BOS 0, visible 1, masked 2
    assert not plan.is_target[:, 0].any() and (plan.group_ids[:, 0] == 0).all()
    assert torch.equal(plan.group_ids[:, 1:], 1 + plan.is_target[:, 1:].long())


@pytest.mark.parametrize("name", list(mdlm.NOISE_SCHEDULES))
def test_each_schedule_weighs_a_token_by_m_prime_over_m(name):
    m, w = mdlm.NOISE_SCHEDULES[name]
    t = np.linspace(0.01, 0.99, 50)
    h = 1e-6
    assert np.allclose(w(t), (m(t + h) - m(t - h)) / (2 * h) / m(t), rtol=1e-4)
    assert (m(t) > 0).all() and (m(t) <= 1).all() and np.all(np.diff(m(t)) > 0)


def test_every_token_after_the_prefix_is_maskable_eos_included():
    lengths = [12] * 200
    plan = mdlm.plan(lengths, 12, num_condition_tokens=1, generator=torch.Generator().manual_seed(1))
    assert plan.is_target[:, 11].any()  # the last position (an EOS in a block) is masked in some rows
    batch = objectives.make_collator("mdlm", ToyTokenizer(VOCAB), seed=3)(docs([12] * 64))
    assert (batch["labels"][:, 11] == EOS).any()


# ---------------------------------------------------------------------------------------------
# the loss: the negative ELBO per token
# ---------------------------------------------------------------------------------------------
def test_the_model_loss_is_the_negative_elbo_per_token(tiny_model):
    lengths = [20, 13, 20, 9]
    collator = objectives.make_collator("mdlm", ToyTokenizer(VOCAB), seed=4)
    batch = collator(docs(lengths))
    model = tiny_model(H.LookAroundForPreTraining)
    loss = model(**batch).loss
    # by hand: every masked token's cross-entropy times 1 / t of its row, over the maskable tokens of the batch
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 group_ids=batch["group_ids"], target_positions=batch["target_positions"])
    slots = batch["target_positions"]
    ce = torch.nn.functional.cross_entropy(full.logits.transpose(1, 2), batch["input_ids"].gather(1, slots.clamp(min=0)),
                                           reduction="none")
    target = batch["labels"] != -100
    m, n = target.sum(), sum(length - 1 for length in lengths)
    inverse_t = batch["loss_weights"].max(1).values * n / m  # the schedule's weight 1 / t of each row
    counts = target.sum(1)
    t = 1 / inverse_t[counts > 0]
    assert ((t > mdlm.DEFAULT_EPS) & (t <= 1)).all()
    ce = ce.detach()
    by_hand = sum(float(ce[b][slots[b] >= 0].sum() * inverse_t[b]) for b in range(len(lengths))) / n
    assert loss.item() == pytest.approx(by_hand, rel=1e-5)
    # the weights are constant within a row: 1 / t is the row's
    for b in range(len(lengths)):
        assert torch.allclose(batch["loss_weights"][b][target[b]], batch["loss_weights"][b][target[b]][0])
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_weights_of_one_give_the_unweighted_loss(tiny_model):
    batch = objectives.make_collator("mlm", ToyTokenizer(VOCAB), seed=0)(docs([20, 20]))
    model = tiny_model(H.LookAroundForPreTraining)
    weights = (batch["labels"] != -100).float()
    assert model(**batch).loss.item() == pytest.approx(model(**batch, loss_weights=weights).loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="loss_weights must have the shape"):
        model(**batch, loss_weights=weights[:, :5])


def test_the_single_stream_form_feeds_mask_at_every_masked_token(tiny_model):
    lengths = [20, 13, 20]
    collator = objectives.make_collator("mdlm", ToyTokenizer(VOCAB), seed=2, form="single_stream")
    batch = collator(docs(lengths))
    original = objectives.make_collator("mdlm", ToyTokenizer(VOCAB), seed=2)(docs(lengths))
    target = original["labels"] != -100  # the same seed draws the same plan in both forms
    assert set(batch) == {"input_ids", "attention_mask", "labels", "loss_weights"}
    assert (batch["input_ids"][target] == MASK).all()  # the absorbing state: no random or kept tokens
    assert torch.equal(batch["input_ids"][~target], original["input_ids"][~target])
    assert torch.equal(batch["labels"], original["labels"]) and torch.equal(batch["loss_weights"],
                                                                            original["loss_weights"])
    model = tiny_model(H.LookAroundForMaskedLM)
    out = model(**batch)
    ce = torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), batch["labels"], reduction="none")
    ce = ce.detach()
    assert out.loss.item() == pytest.approx(float((ce * batch["loss_weights"]).sum() / target.sum()), rel=1e-5)
    with pytest.raises(ValueError, match="no mask token"):
        objectives.make_collator("mdlm", type("NoMask", (ToyTokenizer,), {"mask_token_id": None})(VOCAB),
                                 form="single_stream")


# ---------------------------------------------------------------------------------------------
# mixtures, flags, the command line
# ---------------------------------------------------------------------------------------------
def test_mdlm_joins_a_mixture_with_its_weights():
    lengths = [30] * 16
    weights = {"mdlm": 0.5, "vmlm": 0.5}
    plan, drawn = mixture.plan_and_components(lengths, 30, weights, {"mdlm": {}, "vmlm": {}}, num_condition_tokens=1,
                                              generator=torch.Generator().manual_seed(0))
    is_mdlm = torch.from_numpy(drawn == list(weights).index("mdlm"))
    assert is_mdlm.any() and (~is_mdlm).any()
    w, target = plan.loss_weights, plan.is_target
    assert (w[~is_mdlm][target[~is_mdlm]] == 1).all() and (w[~target] == 0).all()
    # the mdlm rows' weights are normalised over those rows: their mean weight per target is M / N times E[1 / t]
    m, n = target[is_mdlm].sum(), 29 * int(is_mdlm.sum())
    inverse_t = w[is_mdlm].max(1).values * n / m
    assert ((1 / inverse_t[target[is_mdlm].sum(1) > 0]) <= 1).all()
    with pytest.raises(ValueError, match="no such form"):
        mixture.check_one_stream_mixture({"dar": 0.5, "mdlm": 0.5}, {"dar": {"t": 2}})


def test_flags_presets_and_the_table():
    args = ObjectiveArguments(objective="mdlm", noise_schedule="cosine", diffusion_eps=0.01, low_discrepancy=False)
    assert args.plan_params() == {"noise_schedule": "cosine", "eps": 0.01, "low_discrepancy": False}
    assert objectives.get("mdlm").family == objectives.MASKED and objectives.get("mdlm").elbo_plan is mdlm.elbo_plan
    assert "mdlm" in objectives.presets()
    with pytest.raises(ValueError, match="--noise_schedule"):
        ObjectiveArguments(objective="mdlm", noise_schedule="quadratic")


def _pretrain(tmp_path, bbc_text_dir, tokenizer_dir, name, objective_flags, extra=()):
    out = tmp_path / name
    code = cli_main([
        "pretrain", *objective_flags, "--train_files", str(bbc_text_dir / "train.jsonl.gz"),
        "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny", "--config_overrides", TINY, "--block_size", "32",
        "--validation_split_percentage", "0", "--output_dir", str(out), "--per_device_train_batch_size", "4",
        "--max_steps", "2", "--max_train_samples", "8", "--do_train", "--report_to", "none", "--disable_tqdm", "true",
        "--use_cpu", "true", "--save_strategy", "no", "--logging_steps", "1", *extra,
    ])
    assert code == 0
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 2 and all(np.isfinite(losses))
    return out, json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("form", ["two_stream", "single_stream"])
def test_pretrain_mdlm_through_the_cli_and_adapt_it(form, bbc_text_dir, tokenizer_dir, tmp_path):
    out, config = _pretrain(tmp_path, bbc_text_dir, tokenizer_dir, "mdlm",
                            ["--objective", "mdlm", "--noise_schedule", "log_linear", "--masked_form", form])
    assert config["objective"] == "mdlm"
    assert config["plan_params"] == {"noise_schedule": "log_linear", "eps": 1e-3, "low_discrepancy": True}
    assert config["diffusion_block_size"] == 0  # diffusion decoding: one block of every new token
    assert "masked diffusion" in (out / "README.md").read_text()
    # adaptation: continue pretraining from the checkpoint
    _pretrain(tmp_path, bbc_text_dir, tokenizer_dir, "again", ["--objective", "mdlm", "--masked_form", form],
              ["--model_name_or_path", str(out)])


def test_dropping_unread_content_keeps_the_weighted_loss(tiny_model):
    from hf_lookaround.training.unread_content import drop_unread_content

    batch = objectives.make_collator("mdlm", ToyTokenizer(VOCAB), seed=6)(docs([20, 13, 20]))
    model = tiny_model(H.LookAroundForPreTraining)
    compact = drop_unread_content(batch)
    assert "loss_weights" in compact and compact["loss_weights"].shape == compact["query_target_ids"].shape
    assert model(**compact).loss.item() == pytest.approx(model(**batch).loss.item(), rel=1e-5)
