"""Attention-mask annealing (issue 39, DiffuLLaMA): `revealed_keys` restricts the plan's mask toward causal.

Checked from the outside, with gradients: with no key revealed (progress 0) a target's loss reads no later token;
with every key revealed (progress 1) the gradients are the plain objective's; in between a one-layer model reads
exactly what the plain objective lets it read, less the later keys that are not revealed."""

import math

import pytest
import torch

from hf_lookaround import objectives
from hf_lookaround.models.lookaround.masking_lookaround import BIDIRECTIONAL_ROW, BLOCK_CAUSAL_ROW
from hf_lookaround.models.lookaround.modeling_lookaround import (
    LookAroundForCausalLM,
    LookAroundForMaskedLM,
    LookAroundForPreTraining,
)

T = 12


def two_stream_batch(objective, **params):
    plan = objectives.make_plan(objective, torch.full((2,), T), T, generator=torch.Generator().manual_seed(3),
                                num_condition_tokens=1, **params)
    input_ids = torch.randint(1, 61, (2, T), generator=torch.Generator().manual_seed(4))
    return dict(input_ids=input_ids, group_ids=plan.group_ids, target_positions=plan.target_positions()), plan


def reach_of_two_stream(model, batch, revealed, leak_audit):
    """(B, M, T): |d log p(target) / d token| for each target slot of each sequence, and the slots' positions."""
    embeds = model.model.embed_tokens(batch["input_ids"]).detach().requires_grad_(True)
    extra = {} if revealed is None else {"revealed_keys": revealed}
    out = model(inputs_embeds=embeds, group_ids=batch["group_ids"], target_positions=batch["target_positions"],
                **extra)
    logp = out.logits.log_softmax(-1)
    slots = batch["target_positions"]
    labels = batch["input_ids"].gather(1, slots.clamp(min=0))
    picked = logp.gather(-1, labels[..., None])[..., 0]  # (B, M)
    valid = slots >= 0
    rows = [(b, m) for b in range(slots.shape[0]) for m in range(slots.shape[1]) if valid[b, m]]
    reach = leak_audit.reach([picked[b, m] for b, m in rows], embeds)  # (rows, B, T)
    return reach, [(b, int(slots[b, m])) for b, m in rows]


# the two-stream objectives whose targets read later tokens (dar's two-stream targets read earlier groups only: its
# annealing is the one-stream form's, below)
CASES = [("mdlm", {}), ("bd3lm", {"diffusion_block": 4}), ("vmlm", {}), ("gvp", {"num_groups": 3})]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("objective,params", CASES, ids=[c[0] for c in CASES])
def test_two_stream_progress_zero_is_causal_and_one_is_the_objective(tiny_model, leak_audit, impl, objective, params):
    model = tiny_model(LookAroundForPreTraining, impl)
    batch, _ = two_stream_batch(objective, **params)
    none = torch.zeros(2, T, dtype=torch.bool)
    plain, rows = reach_of_two_stream(model, batch, None, leak_audit)
    causal, _ = reach_of_two_stream(model, batch, none, leak_audit)
    full, _ = reach_of_two_stream(model, batch, ~none, leak_audit)
    later_read_plainly = False
    for k, (b, i) in enumerate(rows):
        assert torch.all(causal[k, b, i + 1:] == 0), f"target {i} of sequence {b} reads a later token at progress 0"
        later_read_plainly |= bool((plain[k, b, i + 1:] != 0).any())
    assert later_read_plainly, "the plain objective should read some later token (else the test shows nothing)"
    torch.testing.assert_close(full, plain, rtol=0, atol=0)


def revealed_at_half(shape):
    return torch.rand(shape, generator=torch.Generator().manual_seed(5)) < 0.5


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("objective,params", CASES, ids=[c[0] for c in CASES])
def test_two_stream_in_between_reads_the_objective_less_unrevealed_later_keys(tiny_model, leak_audit, impl,
                                                                               objective, params):
    # one layer: a target reads a token only through the attention of its own row, so the read set is the mask's
    model = tiny_model(LookAroundForPreTraining, impl, num_hidden_layers=1)
    batch, _ = two_stream_batch(objective, **params)
    revealed = revealed_at_half((2, T))
    plain, rows = reach_of_two_stream(model, batch, None, leak_audit)
    annealed, _ = reach_of_two_stream(model, batch, revealed, leak_audit)
    position = torch.arange(T)
    for k, (b, i) in enumerate(rows):
        may_read = (plain[k, b] != 0) & ((position <= i) | revealed[b])
        other = torch.arange(2) != b
        assert torch.all(annealed[k, other] == 0)
        leak_audit.assert_reads_only(annealed[k, b][None], may_read[None], must_read="all",
                                     what=f"target {i} of sequence {b}")


def one_stream_reach(model, input_ids, revealed, leak_audit, **batch_keys):
    """(rows, B, T) reach of every row's log-probability of token 0 (any scalar of the row's output will do)."""
    embeds = model.model.embed_tokens(input_ids).detach().requires_grad_(True)
    extra = {} if revealed is None else {"revealed_keys": revealed}
    logits = model(inputs_embeds=embeds, **batch_keys, **extra).logits
    b_count, width = input_ids.shape
    outputs = [logits[b, i].log_softmax(-1)[0] for b in range(b_count) for i in range(width)]
    return leak_audit.reach(outputs, embeds).view(b_count, width, b_count, width)


ONE_STREAM = {
    "dar_one_stream": (LookAroundForCausalLM, dict(default_attention="block_causal", attention_group_size=2),
                       dict(one_stream_layout=True)),
    "mixture_one_stream": (LookAroundForCausalLM, dict(default_attention="block_causal", attention_group_size=2),
                           dict(row_kind=torch.tensor([BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW]))),
    "bert_form": (LookAroundForMaskedLM, {}, {}),
}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("form", list(ONE_STREAM))
def test_one_stream_forms(tiny_model, leak_audit, impl, form):
    cls, overrides, keys = ONE_STREAM[form]
    input_ids = torch.randint(1, 61, (2, T), generator=torch.Generator().manual_seed(4))
    position = torch.arange(T)
    # two layers: progress 0 is causal, progress 1 the plain mask
    model = tiny_model(cls, impl, **overrides)
    plain = one_stream_reach(model, input_ids, None, leak_audit, **keys)
    none = torch.zeros(2, T, dtype=torch.bool)
    causal = one_stream_reach(model, input_ids, none, leak_audit, **keys)
    assert any(bool((plain[b, i, b, i + 1:] != 0).any()) for b in range(2) for i in range(T))
    for b in range(2):
        for i in range(T):
            assert torch.all(causal[b, i, b, i + 1:] == 0), f"row {i} of sequence {b} reads a later slot at progress 0"
    torch.testing.assert_close(one_stream_reach(model, input_ids, ~none, leak_audit, **keys), plain, rtol=0, atol=0)
    # one layer, in between: exactly the plain mask less the unrevealed later slots
    model = tiny_model(cls, impl, num_hidden_layers=1, **overrides)
    revealed = revealed_at_half((2, T))
    plain = one_stream_reach(model, input_ids, None, leak_audit, **keys)
    annealed = one_stream_reach(model, input_ids, revealed, leak_audit, **keys)
    for b in range(2):
        may_read = (plain[b, :, b] != 0) & ((position[None, :] <= position[:, None]) | revealed[b][None, :])
        leak_audit.assert_reads_only(annealed[b, :, b], may_read, must_read="all", what=f"sequence {b}: row")


def test_annealed_masks_are_built_per_batch_not_cached(tiny_model, leak_audit):
    """The masks built once per shape (block-causal) must not be reused while annealing, nor keep an annealed mask."""
    from hf_lookaround.models.lookaround import masking_lookaround

    model = tiny_model(LookAroundForCausalLM, "sdpa", default_attention="block_causal", attention_group_size=2)
    input_ids = torch.randint(1, 61, (2, T), generator=torch.Generator().manual_seed(4))
    masking_lookaround._STATIC_MASKS.clear()  # the masks built once per shape (block-causal, block diffusion)
    model(input_ids=input_ids, one_stream_layout=True, revealed_keys=torch.zeros(2, T, dtype=torch.bool))
    assert masking_lookaround._STATIC_MASKS == {}
    bd3lm_one_stream(tiny_model, "sdpa")(**bd3lm_one_stream_batch(), one_stream_layout=True,
                                         revealed_keys=torch.zeros(2, 2 * T, dtype=torch.bool))
    assert masking_lookaround._STATIC_MASKS == {}
    prepared = model.prepare_attention(input_ids=input_ids, revealed_keys=torch.zeros(2, T, dtype=torch.bool))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(prepared.mask[:, 0], causal.expand(2, T, T))


def test_flex_attention_block_mask_applies_annealing(static_flex_shapes, tiny_model):
    """FlexAttention: the BlockMask's mask_mod applies the same rule (compared with the dense mask of the plan)."""
    from hf_lookaround.models.lookaround.masking_lookaround import AttentionPlan

    g = torch.Generator().manual_seed(0)
    rank = torch.randint(0, 3, (2, T), generator=g)
    plan = AttentionPlan(query_rank=rank, query_is_strict=torch.zeros(2, T, dtype=torch.bool), key_rank=rank,
                         key_valid=torch.ones(2, T, dtype=torch.bool), row_position=torch.arange(T).repeat(2, 1),
                         key_position=torch.arange(T).repeat(2, 1), key_revealed=revealed_at_half((2, T)))
    block = plan.block_mask()
    dense = plan.dense()[:, 0]
    b, q, k = torch.meshgrid(torch.arange(2), torch.arange(T), torch.arange(T), indexing="ij")
    from_mask_mod = block.mask_mod(b, torch.zeros_like(b), q, k)
    assert torch.equal(from_mask_mod, dense)
    assert not torch.equal(dense, AttentionPlan(plan.query_rank, plan.query_is_strict, plan.key_rank,
                                                plan.key_valid).dense()[:, 0])


def test_revealed_keys_fraction_follows_progress():
    from hf_lookaround.models.lookaround.masking_lookaround import annealing_revealed_keys

    g = torch.Generator().manual_seed(0)
    assert not annealing_revealed_keys(0.0, 4, 256, generator=g).any()
    assert annealing_revealed_keys(1.0, 4, 256, generator=g).all()
    assert abs(annealing_revealed_keys(0.25, 64, 256, generator=g).float().mean().item() - 0.25) < 0.02


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_masks_prepared_outside_the_step_equal_the_forwards_own(static_flex_shapes, tiny_model, impl):
    """--torch_compile builds the masks before the step (`prepare_attention`): with revealed keys they must be the
    forward's own; FlexAttention's BlockMask gives the logits of SDPA's dense mask."""
    batch, _ = two_stream_batch("mdlm")
    revealed = revealed_at_half((2, T))
    reference = tiny_model(LookAroundForPreTraining, "sdpa")
    model = tiny_model(LookAroundForPreTraining, impl)
    with torch.no_grad():
        expected = reference(**batch, revealed_keys=revealed).logits
        prepared = model.prepare_attention(**batch, revealed_keys=revealed)
        got = model(**batch, revealed_keys=revealed, prepared_attention=prepared).logits
        plain = model(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, expected, atol=1e-4)  # the annealing changed the prediction


# BD3-LM's one-stream form (x_t ⊕ x_0, --masked_form single_stream): both copies of token j sit at position j, and
# annealing reveals a token's two copies together (annealing_revealed_keys(copies=2))
BD3LM_BLOCK = 4


def bd3lm_one_stream(tiny_model, impl, **overrides):
    from hf_lookaround.objectives import bd3lm

    fields = bd3lm.Params(diffusion_block=BD3LM_BLOCK, masked_form="single_stream").config_fields()
    return tiny_model(LookAroundForMaskedLM, impl, prediction_stream="content", objective="bd3lm", mask_token_id=3,
                      bos_token_id=1, plan_params={"diffusion_block": BD3LM_BLOCK}, **fields, **overrides)


def bd3lm_one_stream_batch():
    """The collator's x_t ⊕ x_0 batch (B, 2T) of two BOS-led rows; the masked x_t rows carry the labels."""
    from hf_lookaround.objectives.bd3lm import one_stream_layout

    input_ids = torch.randint(5, 61, (2, T), generator=torch.Generator().manual_seed(4))
    input_ids[:, 0] = 1
    plan = objectives.make_plan("bd3lm", torch.full((2,), T), T, generator=torch.Generator().manual_seed(3),
                                num_condition_tokens=1, diffusion_block=BD3LM_BLOCK)
    return one_stream_layout(input_ids, torch.ones_like(input_ids), plan, mask_token_id=3)


def bd3lm_reach(model, batch, revealed, leak_audit):
    """(targets, B, 2T) |d loss / d slot| of every masked x_t row's loss, and the (sequence, position) of each."""
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    extra = {} if revealed is None else {"revealed_keys": revealed}
    logits = model(inputs_embeds=embeds, one_stream_layout=True, **extra).logits
    rows, cols = (batch["labels"] != -100).nonzero(as_tuple=True)
    losses = torch.nn.functional.cross_entropy(logits[rows, cols], batch["labels"][rows, cols], reduction="none")
    return leak_audit.reach(losses, embeds), list(zip(rows.tolist(), cols.tolist()))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bd3lm_one_stream_progress_zero_is_causal_over_both_copies_and_one_is_the_plain_form(tiny_model, leak_audit,
                                                                                            impl):
    from hf_lookaround.models.lookaround.masking_lookaround import annealing_revealed_keys

    model = bd3lm_one_stream(tiny_model, impl)
    batch = bd3lm_one_stream_batch()
    position = torch.arange(2 * T) % T  # x_t then x_0: slot c holds a copy of token c mod T
    plain, targets = bd3lm_reach(model, batch, None, leak_audit)
    assert len(targets) > 3 and all(i < T for _, i in targets)
    causal, _ = bd3lm_reach(model, batch, annealing_revealed_keys(0.0, 2, 2 * T, copies=2), leak_audit)
    later_read_plainly = False
    for k, (b, i) in enumerate(targets):
        later = position > i
        assert torch.all(causal[k, b, later] == 0), f"target {i} of sequence {b} reads a later copy at progress 0"
        later_read_plainly |= bool((plain[k, b, later] != 0).any())
        assert torch.all(causal[k, 1 - b] == 0)
    assert later_read_plainly, "the plain form should read a later token of the target's block (else this shows nothing)"
    full, _ = bd3lm_reach(model, batch, annealing_revealed_keys(1.0, 2, 2 * T, copies=2), leak_audit)
    torch.testing.assert_close(full, plain, rtol=0, atol=0)
    # one layer, in between: exactly the plain form's reads less the later tokens not revealed (both copies alike)
    model = bd3lm_one_stream(tiny_model, impl, num_hidden_layers=1)
    revealed = annealing_revealed_keys(0.5, 2, 2 * T, generator=torch.Generator().manual_seed(5), copies=2)
    assert torch.equal(revealed[:, :T], revealed[:, T:]) and revealed.any() and not revealed.all()
    plain, _ = bd3lm_reach(model, batch, None, leak_audit)
    annealed, _ = bd3lm_reach(model, batch, revealed, leak_audit)
    for k, (b, i) in enumerate(targets):
        may_read = (plain[k, b] != 0) & ((position <= i) | revealed[b])
        assert torch.all(annealed[k, 1 - b] == 0)
        leak_audit.assert_reads_only(annealed[k, b][None], may_read[None], must_read="all",
                                     what=f"target {i} of sequence {b}")


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_bd3lm_one_stream_prepared_masks_keep_the_annealing(static_flex_shapes, tiny_model, impl):
    """--torch_compile builds the masks before the step (`prepare_attention`): they must be the annealed ones."""
    from hf_lookaround.models.lookaround.masking_lookaround import annealing_revealed_keys

    if impl == "flex_attention":
        # inductor's CPU FlexAttention code generation can fail to compile a kernel (an undeclared
        # `cur_kvSplitSize<N>`) after other flex kernels in the same process (tests/test_bd3lm.py before this
        # file); alone it compiles. CPU flex is a test backend only: start from a fresh compile cache.
        torch._dynamo.reset()
    batch = bd3lm_one_stream_batch()
    revealed = annealing_revealed_keys(0.5, 2, 2 * T, generator=torch.Generator().manual_seed(5), copies=2)
    reference, model = bd3lm_one_stream(tiny_model, "sdpa"), bd3lm_one_stream(tiny_model, impl)
    with torch.no_grad():
        expected = reference(**batch, one_stream_layout=True, revealed_keys=revealed).logits
        prepared = model.prepare_attention(**batch, revealed_keys=revealed)
        got = model(**batch, one_stream_layout=True, revealed_keys=revealed, prepared_attention=prepared).logits
        plain = model(**batch, one_stream_layout=True).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, expected, atol=1e-4)  # the annealing changed the prediction


TINY_FLAGS = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


def test_pretrain_anneals_bd3lm_one_stream_revealing_both_copies_of_a_token(bbc_text_dir, tokenizer_dir, tmp_path,
                                                                          monkeypatch):
    """`pretrain --objective bd3lm --masked_form single_stream --attention_annealing_steps 3`: steps 0-2 carry keys
    revealed over the x_t ⊕ x_0 batch (2T wide, a token's two copies alike) at progress 0, 1/3, 2/3; step 3 none."""
    import json

    from hf_lookaround.cli import main as cli_main
    from hf_lookaround.training.pretraining import LookAroundTrainer

    seen = []
    original = LookAroundTrainer.with_attention_annealing

    def spy(self, training, config, inputs):
        out = original(self, training, config, inputs)
        seen.append((self.state.global_step, inputs["input_ids"].shape, out.get("revealed_keys")))
        return out

    monkeypatch.setattr(LookAroundTrainer, "with_attention_annealing", spy)
    out = tmp_path / "bd3lm-annealed"
    code = cli_main([
        "pretrain", "--objective", "bd3lm", "--diffusion_block", "4", "--masked_form", "single_stream",
        "--attention_annealing_steps", "3", "--train_files", str(bbc_text_dir / "train.jsonl.gz"),
        "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny", "--config_overrides", TINY_FLAGS,
        "--block_size", "32", "--validation_split_percentage", "10", "--output_dir", str(out),
        "--per_device_train_batch_size", "4", "--max_steps", "4", "--max_train_samples", "8", "--max_eval_samples",
        "4", "--do_train", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1"])
    assert code == 0
    assert [step for step, _, _ in seen] == [0, 1, 2, 3]
    for step, shape, revealed in seen[:3]:
        assert shape[1] == 64 and revealed is not None and revealed.shape == shape  # x_t ⊕ x_0 of 32 tokens
        assert torch.equal(revealed[:, :32], revealed[:, 32:])
    assert not seen[0][2].any() and seen[1][2].any() and not seen[2][2].all()
    assert seen[3][2] is None
    losses = [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
