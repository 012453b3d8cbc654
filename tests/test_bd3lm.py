"""``bd3lm``: block diffusion (BD3-LM) in one module: block ranks, a time per block, the clipped schedule, the
weights, mixtures and the command line (the leak audit and collator battery: test_objective_collators.py)."""

import json

import numpy as np
import pytest
import torch
import transformers

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
    assert {"bd3lm-4", "bd3lm-16", "bd3lm-4-1s"} <= set(objectives.presets())
    name, _, flags = objectives.presets()["bd3lm-4-1s"]  # the one-stream row: its flags make the x_t ⊕ x_0 form
    fields = ObjectiveArguments(objective=name, **flags).params.config_fields()
    assert (fields["default_attention"], fields["attention_group_size"]) == ("block_diffusion", 4)
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


# ----------------------------------------------------------------------------------------------
# The one-stream form: BD3-LM's vectorised x_t ⊕ x_0 layout (--masked_form single_stream)
# ----------------------------------------------------------------------------------------------
def one_stream_model(tiny_model, b, impl="eager", seed=0):
    """The masked LM of the one-stream form, its config fields as pretraining records them from the Params."""
    fields = bd3lm.Params(diffusion_block=b, masked_form="single_stream").config_fields()
    assert (fields["default_attention"], fields["attention_group_size"]) == ("block_diffusion", b)
    return tiny_model(H.LookAroundForMaskedLM, impl, seed, prediction_stream="content", objective="bd3lm",
                      mask_token_id=3, bos_token_id=BOS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      plan_params={"diffusion_block": b}, **fields)


def one_stream_batch(lengths, b, seed=0, form="single_stream"):
    features = [{"input_ids": [BOS] + [5 + (7 * i + n) % (VOCAB - 5) for i in range(n - 1)]} for n in lengths]
    return objectives.make_collator("bd3lm", ToyTokenizer(VOCAB), seed=seed, diffusion_block=b, form=form)(features)


def block_of(position, b):
    """The block of a text position in the one-stream layout, from the paper's definition: BOS alone, then b."""
    return 0 if position == 0 else 1 + (position - 1) // b


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("lengths", [[13, 13], [13, 9]])  # unpadded (the static mask), padded (built per batch)
def test_a_masked_token_reads_its_noised_block_and_the_clean_blocks_before_it(tiny_model, leak_audit, impl, lengths):
    b = 4
    batch = one_stream_batch(lengths, b, seed=2)
    assert ("attention_mask" in batch) == (len(set(lengths)) > 1)  # only a padded batch carries one
    model = one_stream_model(tiny_model, b, impl)
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, attention_mask=batch.get("attention_mask"), one_stream_layout=True).logits
    width = batch["input_ids"].shape[1]
    T = width // 2
    rows, cols = (batch["labels"] != -100).nonzero(as_tuple=True)
    assert len(rows) > 3 and (cols < T).all()  # the targets: masked x_t rows only
    losses = torch.nn.functional.cross_entropy(logits[rows, cols], batch["labels"][rows, cols], reduction="none")
    reach = leak_audit.reach(losses, embeds)  # (targets, B, 2T)
    may_read = torch.zeros_like(reach, dtype=torch.bool)
    for i, (row, p) in enumerate(zip(rows.tolist(), cols.tolist())):
        for q in range(lengths[row]):  # never a padded slot
            may_read[i, row, q] = block_of(q, b) == block_of(p, b)  # its own noised block
            may_read[i, row, T + q] = block_of(q, b) < block_of(p, b)  # the clean blocks before it
    leak_audit.assert_reads_only(reach, may_read, what="masked target")
    # the clean half of its own block is never read, while its noised block always is (the [MASK] inputs too)
    for i, (row, p) in enumerate(zip(rows.tolist(), cols.tolist())):
        assert reach[i, row, p] > 0 and reach[i, row, T + p] == 0


def test_the_mask_rule_is_one_for_every_kernel_and_flex_gives_the_same_forward(static_flex_shapes, tiny_model):
    from torch.nn.attention.flex_attention import create_mask

    from hf_lookaround.models.lookaround import masking_lookaround as masking

    b, T = 3, 11
    plan = masking.block_diffusion_plan(b, 2 * T, "cpu")
    dense = plan.dense()[0, 0]
    expected = torch.zeros(2 * T, 2 * T, dtype=torch.bool)  # M_BD, M_OBC, M_BC (BD3-LM Eq. 8), by hand
    for i in range(2 * T):
        for j in range(2 * T):
            bi, bj = block_of(i % T, b), block_of(j % T, b)
            if i < T:
                expected[i, j] = bi == bj if j < T else bj < bi
            else:
                expected[i, j] = j >= T and bj <= bi
    assert torch.equal(dense, expected)
    # the BlockMask's mask_mod is the same rule (FlexAttention has no backward on CPU: its forward is compared)
    block_mask = plan.block_mask()
    assert torch.equal(create_mask(block_mask.mask_mod, 1, 1, 2 * T, 2 * T, device="cpu")[0, 0], expected)
    # built once per (length, block size, device): a second batch of the same shape reuses the very same masks
    first = masking.static_masks("block_diffusion", b, 2 * T, "flex_attention", torch.float32, "cpu")
    assert masking.static_masks("block_diffusion", b, 2 * T, "flex_attention", torch.float32, "cpu") is first
    batch = one_stream_batch([T] * 2, b, seed=4)
    with torch.no_grad():
        logits = {impl: one_stream_model(tiny_model, b, impl)(**batch, one_stream_layout=True).logits
                  for impl in ("eager", "sdpa", "flex_attention")}
    torch.testing.assert_close(logits["sdpa"], logits["eager"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["flex_attention"], logits["eager"], atol=1e-5, rtol=1e-5)


def test_the_one_stream_loss_is_the_two_stream_definition_block_by_block(tiny_model):
    """Same seed, same plan: the one-stream batch holds the two-stream batch's targets and weights, and its loss equals
    an independent reference that runs each block on its own: the clean prefix into a cache (block-causal ranks),
    then the noised block on top of it (bidirectional within the block)."""
    b, lengths = 4, [14, 14, 14]
    one = one_stream_batch(lengths, b, seed=6)
    two = one_stream_batch(lengths, b, seed=6, form="two_stream")
    T = two["input_ids"].shape[1]
    assert torch.equal(one["labels"][:, :T], two["labels"]) and (one["labels"][:, T:] == -100).all()
    assert torch.equal(one["loss_weights"][:, :T], two["loss_weights"])
    assert torch.equal(one["input_ids"][:, T:], two["input_ids"])
    assert torch.equal(one["input_ids"][:, :T], torch.where(two["labels"] != -100, 3, two["input_ids"]))
    model = one_stream_model(tiny_model, b)
    with torch.no_grad():
        loss = model(**one, one_stream_layout=True).loss
        total = torch.zeros(())
        clean, noised = two["input_ids"], one["input_ids"][:, :T]
        rank = torch.tensor([0] + [1 + 2 * ((p - 1) // b) for p in range(1, T)]).expand(len(lengths), T)
        for start in range(1, T, b):
            end = min(start + b, T)
            cache = transformers.DynamicCache(config=model.config)
            model.model(input_ids=clean[:, :start], group_ids=rank[:, :start], use_cache=True,
                        past_key_values=cache)
            out = model.model(input_ids=noised[:, start:end], group_ids=rank[:, :end], use_cache=True,
                              past_key_values=cache, position_ids=torch.arange(start, end).expand(len(lengths), -1))
            logits = model.lm_head(out.last_hidden_state)
            labels = two["labels"][:, start:end]
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
            total += (ce * two["loss_weights"][:, start:end] * (labels != -100)).sum()
    assert loss.item() == pytest.approx(float(total / (two["labels"] != -100).sum()), rel=1e-5)


def test_the_one_stream_form_trains_saves_reloads_and_decodes(bbc_text_dir, tokenizer_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    out = tmp_path / "bd3lm-1s"
    code = cli_main([
        "pretrain", "--objective", "bd3lm", "--diffusion_block", "4", "--masked_form", "single_stream",
        "--train_files", str(bbc_text_dir / "train.jsonl.gz"), "--tokenizer_name", str(tokenizer_dir), "--preset",
        "tiny", "--config_overrides", TINY, "--block_size", "32", "--validation_split_percentage", "10",
        "--output_dir", str(out), "--per_device_train_batch_size", "4", "--max_steps", "3", "--max_train_samples",
        "8", "--max_eval_samples", "4", "--perplexity_max_tokens", "64", "--do_train", "--do_eval", "--report_to",
        "none", "--disable_tqdm", "true", "--use_cpu", "true", "--save_strategy", "no", "--logging_steps", "1",
    ])
    assert code == 0
    evaluated = json.loads((out / "eval_results.json").read_text())  # the held-out score: its ELBO, a bound
    assert np.isfinite(evaluated["eval_loss"]) and np.isfinite(evaluated["eval_elbo_perplexity"])
    losses = [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(losses) == 3 and np.isfinite(losses).all()
    config = json.loads((out / "config.json").read_text())
    assert (config["default_attention"], config["attention_group_size"], config["prediction_stream"]) == \
        ("block_diffusion", 4, "content")
    assert config["diffusion_block_size"] == 4
    assert "BD3-LM's x_t ⊕ x_0" in (out / "README.md").read_text()  # the card says which form it is
    # the masked LM reloads through the Auto classes and gives the loss it trained with on a collated batch
    tokenizer = AutoTokenizer.from_pretrained(out)
    masked = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(masked).__name__ == "LookAroundForMaskedLM"
    ids = tokenizer("The company said on Monday that profits rose.")["input_ids"]
    batch = objectives.make_collator("bd3lm", tokenizer, seed=0, diffusion_block=4, form="single_stream")(
        [{"input_ids": [tokenizer.bos_token_id] + ids}] * 2)
    with torch.no_grad():
        assert torch.isfinite(masked(**batch, one_stream_layout=True).loss)
    with pytest.raises(ValueError, match="one_stream_layout=True"):  # plain [MASK] inputs are not its layout
        masked(**{k: v for k, v in batch.items()})
    # generate(diffusion_threshold=...) decodes it block by block, with a cache and without (the same tokens)
    causal = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tokenizer(["The company said", "Profits rose"], return_tensors="pt", padding=True, padding_side="left")
    kwargs = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, eos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id)
    cached = causal.generate(**prompt, diffusion_threshold=0.5, **kwargs)
    uncached = causal.generate(**prompt, diffusion_threshold=0.5, use_cache=False, **kwargs)
    assert cached.sequences.shape == (2, prompt["input_ids"].shape[1] + 10)
    assert torch.equal(cached.sequences, uncached.sequences)
    new = cached.sequences[:, prompt["input_ids"].shape[1]:]
    assert not (new == tokenizer.mask_token_id).any() and cached.num_forwards >= 3  # 3 blocks of 4: one or more each
    with pytest.raises(ValueError, match="no causal LM view"):
        causal(**prompt)
    # perplexity --protocol elbo scores it (through AutoModelForMaskedLM, the x_t ⊕ x_0 layout)
    assert cli_main(["perplexity", "--model_name_or_path", str(out), "--dataset", str(bbc_text_dir), "--protocol",
                     "elbo", "--max_length", "32", "--max_documents", "2", "--num_samples", "2", "--output_dir",
                     str(tmp_path / "elbo"), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "elbo" / "perplexity.json").read_text())
    assert report["protocol"] == "elbo" and np.isfinite(report["nll_per_token"]) and report["standard_error"] > 0


@pytest.mark.parametrize("threshold", [0.05, 1.5])
def test_one_stream_decoding_gives_the_tokens_of_the_training_layout(tiny_model, threshold):
    """The decoder (cache, noised rows in place of query rows) against greedy decoding written from the training
    forward alone: each step the whole x_t ⊕ x_0 layout through the masked LM, the prompt ending on a block edge."""
    b, new = 4, 8
    causal = one_stream_model(tiny_model, b, seed=3)
    config = causal.config
    causal = H.LookAroundForCausalLM(config).eval()
    causal.load_state_dict(one_stream_model(tiny_model, b, seed=3).state_dict())
    masked = one_stream_model(tiny_model, b, seed=3)
    prompt = [BOS] + [7 + 3 * i for i in range(2 * b)]  # BOS and two whole blocks
    P = len(prompt)
    ids, committed = prompt + [3] * new, [True] * P + [False] * new
    with torch.no_grad():
        for start in range(P, P + new, b):
            while not all(committed[start:start + b]):
                noised = [t if c else 3 for t, c in zip(ids, committed)]
                logits = masked(input_ids=torch.tensor([noised + ids]), one_stream_layout=True).logits[0]
                logits = logits[start:start + b].float()
                logits[:, 3] = float("-inf")
                confidence, tokens = logits.softmax(-1).max(-1)
                confidence = torch.where(torch.tensor(committed[start:start + b]), -1.0, confidence)
                best = int(confidence.argmax())
                for slot in range(b):
                    if not committed[start + slot] and (confidence[slot] >= threshold or slot == best):
                        ids[start + slot], committed[start + slot] = int(tokens[slot]), True
        decoded = causal.generate(torch.tensor([prompt]), max_new_tokens=new, diffusion_threshold=threshold,
                                  eos_token_id=None, pad_token_id=0, do_sample=False)
    assert decoded.tolist() == [ids]


def test_the_one_stream_elbo_matches_the_exact_enumeration(tiny_model):
    """``perplexity --protocol elbo``'s Monte-Carlo estimate on the one-stream form (masks built from the drawn plan's
    blocks) against the exact negative ELBO from the training layout's forward: every mask of every block, its
    [MASK] inputs in x_t, weighted by the mask's probability under the block's time."""
    import itertools

    from hf_lookaround.evaluation.perplexity import elbo_window_nlls
    from test_elbo import EPS, weight_integral

    b = 3
    model = one_stream_model(tiny_model, b, seed=1)
    model.config.plan_params = {"diffusion_block": b, "noise_schedule": "linear", "eps": EPS}
    ids = [BOS, 17, 5, 42, 9, 33, 21]
    n = len(ids) - 1
    exact = 0.0
    with torch.no_grad():
        for start in range(1, n + 1, b):
            members = list(range(start, min(start + b, n + 1)))
            for k in range(1, len(members) + 1):
                for masked in itertools.combinations(members, k):
                    noised = [3 if i in masked else t for i, t in enumerate(ids)]
                    logits = model(input_ids=torch.tensor([noised + ids]), one_stream_layout=True).logits[0]
                    nll = -torch.log_softmax(logits[list(masked)], -1)[torch.arange(k), [ids[i] for i in masked]]
                    exact += float(nll.sum()) * weight_integral(k, len(members))
        exact /= n
        totals = elbo_window_nlls(model, [ids] * 300, 1, 4, torch.Generator().manual_seed(0), 0, mask_id=3)
    samples = totals.reshape(-1) / n
    estimate, error = samples.mean(), samples.std(ddof=1) / np.sqrt(samples.size)
    assert abs(estimate - exact) < 4 * error, (estimate, exact, error)
    assert error < 0.05 * exact


@pytest.mark.parametrize("check", ["test_keys_shapes_and_labels_where_the_plan_has_targets",
                                   "test_no_target_sees_itself", "test_a_seed_gives_one_batch",
                                   "test_max_targets_bounds_the_targets"])
def test_the_one_stream_form_passes_the_collator_battery(check):
    """The shared battery (test_objective_collators.py) on the one-stream form, which no preset of the table names
    (as mdlm's); its leak audit is the gradient test above (a single-stream form carries no plan ranks)."""
    import test_objective_collators as battery

    getattr(battery, check)("bd3lm", {"diffusion_block": 4, "masked_form": "single_stream"})


def test_prepared_masks_are_the_static_ones_and_give_the_same_forward(tiny_model):
    """Under --torch_compile the Trainer builds the masks outside the graph (model.prepare_attention): for the
    one-stream form, the masks built once per shape, which a forward then reads as they are."""
    from hf_lookaround.models.lookaround import masking_lookaround as masking

    b = 4
    model = one_stream_model(tiny_model, b, "sdpa")
    batch = one_stream_batch([13, 13], b, seed=5)
    prepared = model.prepare_attention(**batch)
    assert prepared is masking.static_masks("block_diffusion", b, 26, "sdpa", torch.float32, "cpu")
    with torch.no_grad():
        plain = model(**batch, one_stream_layout=True)
        given = model(**batch, one_stream_layout=True, prepared_attention=prepared)
    torch.testing.assert_close(given.logits, plain.logits)
    torch.testing.assert_close(given.loss, plain.loss)
    padded = one_stream_batch([13, 9], b, seed=5)  # padding: masks of this batch, from the same rule
    assert model.prepare_attention(**padded).mask.shape == (2, 1, 26, 26)
