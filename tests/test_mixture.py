"""Issue 18: a mixture objective (UL2-style): each sequence draws one component objective from weights."""

import json
import math

import pytest
import torch

import hf_lookaround as H
from hf_lookaround.objectives import mixture
from hf_lookaround import objectives, plans
from hf_lookaround.cli import main as cli_main
from hf_lookaround.objectives import make_collator, max_targets
from hf_lookaround.leakcheck import audit_two_stream
from hf_lookaround.models.lookaround import decoding_lookaround
from hf_lookaround.training.pretraining import ObjectiveArguments

TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"
COMPONENTS = {"dar": {"t": [1, 2]}, "vmlm": {"mask_ratio_range": [0.15, 0.3]}}


def _dar_rule(g, target, n, c, sizes):
    """Row ranks (after c condition tokens) are a semi-AR plan with some t in sizes."""
    ranks = g[c:n] - (1 if c else 0)
    for t in sizes:
        for s1 in range(1, t + 1):
            i = torch.arange(n - c)
            want = torch.where(i < s1, 0, 1 + torch.div(i - s1, t, rounding_mode="floor"))
            if torch.equal(ranks, want) and torch.equal(target[c:n], want + (1 if c else 0) >= 1):
                return True
    return False


def _masked_rule(g, target, n, c, a, b):
    body, tgt = g[c:n] - (1 if c else 0), target[c:n]
    count = int(tgt.sum())
    return (set(body.tolist()) <= {0, 1} and torch.equal(body == 1, tgt)
            and math.floor(a * (n - c)) - 1 <= count <= math.ceil(b * (n - c)) + 1)


@pytest.mark.parametrize("weights", [{"dar": 0.5, "vmlm": 0.5}, {"dar": 1.0, "vmlm": 3.0}])
def test_drawn_components_follow_the_weights_and_each_row_is_its_components_plan(weights):
    batch, seq_len, c = 4000, 24, 1
    lengths = torch.randint(12, seq_len + 1, (batch,), generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(0)
    drawn = mixture.mixture_row_components(lengths, seq_len, weights, COMPONENTS, generator=gen)
    gen = torch.Generator().manual_seed(0)
    plan = mixture.plan(lengths, seq_len, weights, COMPONENTS, num_condition_tokens=c, generator=gen)
    # binomial test: the share of dar rows is p = w_dar / total within 4 standard deviations
    p = weights["dar"] / sum(weights.values())
    k = sum(d == "dar" for d in drawn)
    assert abs(k - batch * p) < 4 * math.sqrt(batch * p * (1 - p)), (k, batch * p)
    for b in range(batch):
        g, target, n = plan.group_ids[b], plan.is_target[b], int(lengths[b])
        assert (g[n:] == 0).all() and not target[n:].any() and g[0] == 0 and not target[0]
        if drawn[b] == "dar":
            assert _dar_rule(g, target, n, c, [1, 2]), b
        else:
            assert _masked_rule(g, target, n, c, 0.15, 0.3), b
    again = mixture.plan(lengths, seq_len, weights, COMPONENTS, num_condition_tokens=c,
                               generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.group_ids, plan.group_ids) and torch.equal(again.is_target, plan.is_target)
    other = mixture.plan(lengths, seq_len, weights, COMPONENTS, num_condition_tokens=c,
                               generator=torch.Generator().manual_seed(1))
    assert not torch.equal(other.group_ids, plan.group_ids)


def test_collator_is_deterministic_never_masks_specials_and_passes_the_leak_audit(tokenizer, tiny_model):
    rows = [[tokenizer.bos_token_id] + list(range(10, 10 + n)) + [tokenizer.eos_token_id] for n in (14, 18, 9, 18)]
    features = [{"input_ids": r} for r in rows]
    collator = make_collator("mixture", tokenizer, mixture={"dar": 1, "vmlm": 1}, components=COMPONENTS, seed=3,
                             pad_targets_to=max_targets("mixture", 20, **{"mixture": {"dar": 1, "vmlm": 1},
                                                                           "components": COMPONENTS}))
    out, again = collator(features), collator(features)
    assert all(torch.equal(out[k], again[k]) for k in out)
    assert out["target_positions"].shape == (4, 20)  # max over components: dar may predict every token
    specials = torch.isin(out["input_ids"], torch.tensor([tokenizer.bos_token_id, tokenizer.eos_token_id]))
    masked_rows = out["group_ids"].max(-1).values == 2  # a vmlm row: ranks 0 (BOS), 1 visible, 2 masked
    assert not (out["labels"].ne(-100) & specials & masked_rows[:, None]).any()
    model = tiny_model(H.LookAroundForPreTraining, vocab_size=len(tokenizer), max_position_embeddings=32)
    plan_targets = out["labels"] != -100
    report = audit_two_stream(model, out["input_ids"], out["attention_mask"], out["group_ids"], plan_targets)
    assert report.leaks == [] and report.blind == [] and report.targets_checked == int(plan_targets.sum())


@pytest.mark.parametrize("extra,message", [
    (["--mixture", "dar=0.5", "dar=0.3"], "given twice"),
    (["--mixture", "dar"], "not NAME=WEIGHT"),
    (["--mixture", "foo=1"], "unknown objective 'foo'"),
    (["--mixture", "mixture=1"], "cannot itself be a mixture"),
    (["--mixture", "dar=-1", "vmlm=1"], ">= 0"),
    (["--mixture", "dar=0", "vmlm=0"], "sum to 0"),
    (["--mixture", "dar=1", "--group_size", "0"], "component 'dar'"),
    (["--mixture", "vmlm=1", "--mask_ratio_range", "0.5", "0.2"], "component 'vmlm'"),
    ([], "needs its components"),
])
def test_bad_mixtures_give_one_clear_line(extra, message, capsys, tmp_path):
    code = cli_main(["pretrain", "--objective", "mixture", *extra, "--output_dir", str(tmp_path), "--do_train",
                     "--train_files", str(tmp_path / "none.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    with pytest.raises(ValueError, match="only with --objective mixture"):
        ObjectiveArguments(objective="dar", mixture=["dar=1"])


def test_python_form_and_what_the_table_says():
    args = ObjectiveArguments(objective="mixture", mixture=["dar=0.5", "vmlm=0.5"], group_size=[1, 2],
                              mask_ratio_range=[0.15, 0.3])
    params = args.plan_params()
    assert params == {"mixture": {"dar": 0.5, "vmlm": 0.5}, "components": COMPONENTS}
    assert ObjectiveArguments(objective="mixture", mixture=["dar=1", "vmlm=3"]).plan_params()["mixture"] == {
        "dar": 0.25, "vmlm": 0.75}
    assert objectives.decoders("mixture", params) == (objectives.GROUP_DECODING, objectives.INFILLING)
    assert objectives.decoders("mixture", {"mixture": {"vmlm": 1}}) == (objectives.INFILLING,)
    assert objectives.default_attention("mixture", params) == "causal"
    assert decoding_lookaround.MIXTURE_OBJECTIVE in objectives.names(objectives.MIXTURE)
    text = objectives.card_text("mixture", params)
    assert "`dar`" in text and "`vmlm`" in text and "weight 0.5" in text and "AR plan" in text


def test_pretrain_a_mixture_through_the_cli_then_decode(bbc_text_dir, tokenizer_dir, tmp_path):
    from hf_lookaround.decoding.infill import infill

    text = bbc_text_dir / "train.jsonl.gz"
    tok = tokenizer_dir
    out = tmp_path / "mixture"
    code = cli_main([
        "pretrain", "--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5", "--group_size", "1", "2",
        "--mask_ratio_range", "0.15", "0.3", "--train_files", str(text), "--tokenizer_name", str(tok),
        "--preset", "tiny", "--config_overrides", TINY, "--block_size", "32", "--validation_split_percentage", "0",
        "--output_dir", str(out), "--per_device_train_batch_size", "4", "--max_steps", "3",
        "--max_train_samples", "12", "--do_train", "--report_to", "none", "--disable_tqdm", "true",
        "--use_cpu", "true", "--save_strategy", "no", "--logging_steps", "1",
    ])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["objective"] == "mixture" and config["mixture"] == {"dar": 0.5, "vmlm": 0.5}
    assert config["plan_params"] == {"mixture": {"dar": 0.5, "vmlm": 0.5}, "components": COMPONENTS}
    assert config["default_attention"] == "causal" and config["prediction_stream"] == "query"
    card = (out / "README.md").read_text()
    assert "`dar`" in card and "`vmlm`" in card and "weight 0.5" in card

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3]
    causal = H.LookAroundForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([[tokenizer.bos_token_id] + tokenizer("The government said", add_special_tokens=False)
                           ["input_ids"]])
    generated = causal.generate(prompt, group_size=2, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == prompt.shape[1] + 4
    with pytest.raises(decoding_lookaround.UntrainedDecodingError, match=r"group_size=4 was not trained.*\[1, 2\]"):
        causal.generate(prompt, group_size=4, max_new_tokens=4)
    pretraining = H.LookAroundForPreTraining.from_pretrained(out).eval()
    filled = infill(pretraining, tokenizer, prompt[0], hidden=[2, 3], steps=2)
    assert filled.sequences.shape == (1, prompt.shape[1])


def test_a_mixture_records_what_its_components_record_and_refuses_a_conflict():
    """One rule (``merge_config_fields``): the components' config fields, lists as their union, any other value
    the same in every component that records it."""
    def fields(*mix, **flags):
        return ObjectiveArguments(objective="mixture", mixture=list(mix), **flags).params.config_fields()

    dar_mdlm = fields("dar=0.5", "mdlm=0.5", group_size=[1, 2])
    assert dar_mdlm == {"decoding_group_sizes": [1, 2], "diffusion_block_size": 0}  # mdlm's one block
    assert fields("bd3lm=1", "vmlm=1", diffusion_block=8) == {"decoding_group_sizes": [], "diffusion_block_size": 8}
    assert "diffusion_block_size" not in fields("dar=1", "vmlm=1")  # no diffusion component: none recorded
    assert "diffusion_block_size" not in fields("dar=1", "mdlm=0")  # a component of weight 0 trains nothing
    # dar's one-stream pattern, as the one-stream mixture recorded it before the merge
    one_stream = fields("dar=0.5", "vmlm=0.5", group_size=[2], dar_form="single_stream", masked_form="single_stream")
    assert one_stream == {"decoding_group_sizes": [2], "default_attention": "block_causal", "attention_group_size": 2}
    with pytest.raises(ValueError, match=r"different diffusion_block_size \(0 for 'mdlm', 4 for 'bd3lm'\)") as err:
        fields("mdlm=0.5", "bd3lm=0.5", diffusion_block=4)
    assert "\n" not in str(err.value)
    assert mixture.merge_config_fields({"a": {"sizes": [2, 1], "b": 3}, "c": {"sizes": [4, 2], "b": 3}}) == {
        "sizes": [1, 2, 4], "b": 3}


def test_pretrain_a_mixture_with_a_diffusion_component_then_decode_by_diffusion(bbc_text_dir, tokenizer_dir,
                                                                                 tmp_path):
    from transformers import AutoTokenizer

    from hf_lookaround.decoding import GenerateDiffusionOutput

    out = tmp_path / "dar-bd3lm"
    code = cli_main([
        "pretrain", "--objective", "mixture", "--mixture", "dar=0.5", "bd3lm=0.5", "--group_size", "2",
        "--diffusion_block", "4", "--train_files", str(bbc_text_dir / "train.jsonl.gz"), "--tokenizer_name",
        str(tokenizer_dir), "--preset", "tiny", "--config_overrides", TINY, "--block_size", "32",
        "--validation_split_percentage", "0", "--output_dir", str(out), "--per_device_train_batch_size", "4",
        "--max_steps", "2", "--max_train_samples", "8", "--do_train", "--report_to", "none", "--disable_tqdm",
        "true", "--use_cpu", "true", "--save_strategy", "no",
    ])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["diffusion_block_size"] == 4 and config["decoding_group_sizes"] == [2]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = torch.tensor([[tokenizer.bos_token_id] + tokenizer("The government said", add_special_tokens=False)
                           ["input_ids"]])
    causal = H.LookAroundForCausalLM.from_pretrained(out).eval()
    result = causal.generate(prompt, diffusion_threshold=0.9, max_new_tokens=6, eos_token_id=None,
                             return_dict_in_generate=True)
    assert isinstance(result, GenerateDiffusionOutput)  # decoded by diffusion, not refused as untrained
    assert result.sequences.shape == (1, prompt.shape[1] + 6) and 1 <= result.num_forwards <= 6
    assert causal.generate(prompt, group_size=2, max_new_tokens=4).shape[1] == prompt.shape[1] + 4  # dar's half
    pytest.importorskip("lm_eval")
    from hf_lookaround.evaluation.lm_eval_model import LookAroundLM

    assert LookAroundLM(pretrained=str(out), device="cpu").decoder == "diffusion"  # lm-eval's generate_until
