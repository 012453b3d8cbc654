"""``bd3lm``: block diffusion (BD3-LM) in one module: block ranks, a time per block, the clipped schedule, the
weights, mixtures and the command line (the leak audit and collator battery: test_objective_collators.py)."""

import json

import numpy as np
import pytest
import torch

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.cli import main as cli_main
from hf_lookaround.objectives import bd3lm, mixture
from hf_lookaround.training.pretraining import ObjectiveArguments
from conftest import BOS, EOS, TINY_TEXT, ToyTokenizer

VOCAB = TINY_TEXT["vocab_size"]
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("b", [1, 3, 4])
def test_block_k_unmasked_rank_2k_masked_2k_plus_1(prefix, b):
    lengths = torch.tensor([17, 12, 17, prefix])
    plan = bd3lm.elbo_plan(lengths, 17, diffusion_block=b, num_condition_tokens=prefix,
                           generator=torch.Generator().manual_seed(b))
    base = 1 if prefix else 0
    for row, length in enumerate(lengths.tolist()):
        g, target = plan.group_ids[row], plan.is_target[row]
        assert (g[:prefix] == 0).all() and (g[length:] == 0).all() and not target[length:].any()
        for i in range(prefix, length):
            k = (i - prefix) // b
            assert int(g[i]) == base + 2 * k + int(target[i])
        # one time per block: the per-row weights 1 / (t n) are constant within a block
        w = plan.loss_weights[row]
        for k in range(-(-(length - prefix) // b)):
            block = slice(prefix + k * b, min(prefix + (k + 1) * b, length))
            assert w[block][target[block]].unique().numel() <= 1


def test_each_block_draws_its_own_time_and_the_clip_bounds_them():
    rows, length, b = 300, 1 + 8 * 16, 16
    plan = bd3lm.elbo_plan([length] * rows, length, diffusion_block=b, num_condition_tokens=1,
                           generator=torch.Generator().manual_seed(0))
    w = plan.loss_weights[:, 1:].reshape(rows, 8, b)
    t = 1 / (w.max(-1).values.double() * (length - 1))  # the time of each block with a masked token
    seen = torch.isfinite(t)
    # blocks of one row have different times (independent or stratified draws, not one per row)
    assert (t[seen.all(1)].std(1) > 0.05).float().mean() > 0.9
    # BD3-LM's clip: training times t ~ U[beta, omega], so each block masks between beta and omega of its tokens
    # on average; the ELBO's times stay (eps, 1]
    clipped = bd3lm.plan([length] * rows, length, diffusion_block=b, noise_clip=(0.3, 0.8), num_condition_tokens=1,
                         generator=torch.Generator().manual_seed(0))
    rate = clipped.is_target[:, 1:].reshape(rows, 8, b).double().mean(-1)
    assert abs(float(rate.mean()) - 0.55) < 0.02
    # and the weights 1 / t (times M / N) of its blocks span at most omega / beta
    weights = clipped.loss_weights[clipped.is_target]
    assert float(weights.max() / weights.min()) <= 0.8 / 0.3 * (1 + 1e-5)
    assert float(weights.max() / weights.min()) > 0.9 * 0.8 / 0.3


def test_one_block_is_mdlm_and_b_1_masks_one_token_per_block():
    lengths, generator = [20, 11], torch.Generator().manual_seed(3)
    whole = bd3lm.plan(lengths, 20, diffusion_block=19, num_condition_tokens=1, generator=generator)
    assert (whole.group_ids[:, 1:] <= 2).all()  # one block: mdlm's ranks (BOS 0, visible 1, masked 2)
    single = bd3lm.plan(lengths, 20, diffusion_block=1, num_condition_tokens=1,
                        generator=torch.Generator().manual_seed(3))
    # b = 1: a masked token sees every earlier token and nothing after: the AR context
    assert torch.equal((single.group_ids[0, 1:] - 1) // 2, torch.arange(19))


def test_the_model_loss_is_the_negative_elbo_per_token(tiny_model):
    lengths = [21, 14, 21]
    batch = objectives.make_collator("bd3lm", ToyTokenizer(VOCAB), seed=1, diffusion_block=4)(
        [{"input_ids": [BOS] + list(range(5, 5 + n - 2)) + [EOS]} for n in lengths])
    model = tiny_model(H.LookAroundForPreTraining)
    loss = model(**batch).loss
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   group_ids=batch["group_ids"], target_positions=batch["target_positions"]).logits.detach()
    slots = batch["target_positions"]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"].gather(1, slots.clamp(min=0)),
                                           reduction="none")
    weights = batch["loss_weights"].gather(1, slots.clamp(min=0))
    target = batch["labels"] != -100
    assert loss.item() == pytest.approx(float((ce * weights)[slots >= 0].sum() / target.sum()), rel=1e-5)
    # the weights are 1 / t of each block times M / N: their mean over the targets estimates E[1/t] M / N
    n = sum(length - 1 for length in lengths)
    assert ((batch["loss_weights"][target] * n / target.sum()) >= 1).all()  # 1 / t >= 1


def test_flags_the_table_and_a_mixture():
    args = ObjectiveArguments(objective="bd3lm", diffusion_block=16, noise_clip=[0.3, 0.8])
    assert args.plan_params() == {"noise_schedule": "linear", "eps": 1e-3, "low_discrepancy": True,
                                  "diffusion_block": 16, "noise_clip": [0.3, 0.8]}
    for bad, flag in (({"diffusion_block": 0}, "--diffusion_block"), ({"noise_clip": [0.8, 0.3]}, "--noise_clip"),
                      ({"masked_form": "one_stream"}, "--masked_form")):
        with pytest.raises(ValueError, match=flag):
            ObjectiveArguments(objective="bd3lm", **bad)
    assert {"bd3lm-4", "bd3lm-16"} <= set(objectives.presets())
    assert objectives.get("bd3lm").elbo_plan is bd3lm.elbo_plan
    plan, drawn = mixture.plan_and_components([20] * 12, 20, {"bd3lm": 0.5, "dar": 0.5},
                                              {"bd3lm": {"diffusion_block": 4}, "dar": {}}, num_condition_tokens=1,
                                              generator=torch.Generator().manual_seed(0))
    names = list(mixture.check_mixture({"bd3lm": 0.5, "dar": 0.5})[0])  # the table's order
    rows = torch.from_numpy(drawn == names.index("bd3lm"))
    assert rows.any() and (~rows).any()
    assert (plan.loss_weights[~rows][plan.is_target[~rows]] == 1).all()
    assert (plan.group_ids[rows].max(1).values > 2).all()  # bd3lm's rows keep their block ranks


def test_pretrain_bd3lm_through_the_cli(bbc_text_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "bd3lm"
    code = cli_main([
        "pretrain", "--objective", "bd3lm", "--diffusion_block", "8", "--train_files",
        str(bbc_text_dir / "train.jsonl.gz"), "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny",
        "--config_overrides", TINY, "--block_size", "32", "--validation_split_percentage", "0", "--output_dir",
        str(out), "--per_device_train_batch_size", "4", "--max_steps", "2", "--max_train_samples", "8", "--do_train",
        "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true", "--save_strategy", "no",
        "--logging_steps", "1",
    ])
    assert code == 0
    losses = [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(losses) == 2 and np.isfinite(losses).all()
    config = json.loads((out / "config.json").read_text())
    assert config["objective"] == "bd3lm" and config["plan_params"]["diffusion_block"] == 8
    assert config["diffusion_block_size"] == 8  # what diffusion decoding reads, recorded from the objective's Params
    assert "block diffusion" in (out / "README.md").read_text()
