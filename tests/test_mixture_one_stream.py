"""The one-stream mixture (issue 33): dar's rows in SAT's one-stream form (block-causal) and vmlm's rows in BERT's
[MASK] form (bidirectional) in one batch, each row's mask selected by its kind.

Checked from the outside: the loss at each dar target has gradient from exactly the groups before its own, each
masked row's loss from every token of its own text and nothing else, on eager and SDPA; FlexAttention (no CPU
backward) through its mask_mod evaluated densely, its assembled BlockMask, and a forward equal to SDPA's; the
command trains it and the checkpoint loads as a causal LM and as a masked LM.
"""

import json
import warnings

import numpy as np
import pytest
import torch

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.cli import main as cli_main
from hf_lookaround.models.lookaround import masking_lookaround as masking
from hf_lookaround.models.lookaround.masking_lookaround import BIDIRECTIONAL_ROW, BLOCK_CAUSAL_ROW
from hf_lookaround.objectives import dar
from hf_lookaround.training.pretraining import ObjectiveArguments
from conftest import BOS, MASK, PAD, ToyTokenizer

VOCAB = 61
MIXTURE = {"dar": 0.5, "vmlm": 0.5}


def blocks(batch: int, length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": [BOS] + rng.integers(4, VOCAB, length - 1).tolist()} for _ in range(batch)]


def collate(t: int, batch: int = 16, length: int = 14, seed: int = 0):
    collator = objectives.make_collator("mixture", ToyTokenizer(VOCAB), mixture=MIXTURE,
                                        components={"dar": {"t": t}, "vmlm": {"mask_ratio_range": (0.15, 0.3)}},
                                        form="single_stream", seed=seed)
    return collator(blocks(batch, length, seed))


def mixture_model(tiny_model, t: int, impl: str = "eager", seed: int = 0):
    return tiny_model(H.LookAroundForCausalLM, impl, seed=seed, default_attention="block_causal",
                      attention_group_size=t, prediction_stream="content", objective="mixture",
                      plan_params={"mixture": MIXTURE, "components": {"dar": {"t": t}}})


def dar_layout(row: torch.Tensor, t: int):
    """(shift, s1) of a dar row: how many BOS copies stand before the text's BOS, and its first group's size."""
    shift = int(torch.cumprod((row == BOS).long(), 0).sum()) - 1
    return shift, 2 * t - 1 - shift


def plan_rank(p: int, s1: int, t: int) -> int:
    """The two-stream plan's rank of text position p (>= 1) after BOS (rank 0)."""
    return 0 if p == 0 else int(dar.ranks(np.array(p - 1), s1, t, 1))


@pytest.mark.parametrize("t", [2, 3])
def test_each_row_is_laid_out_in_its_components_form(t):
    length, texts = 14, blocks(16, 14, seed=1)
    batch = collate(t, seed=1)
    width = length + 2 * t - 2
    assert set(batch) == {"input_ids", "labels", "row_kind"}
    assert batch["input_ids"].shape == batch["labels"].shape == (16, width)
    kinds = batch["row_kind"].tolist()
    assert set(kinds) == {BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW}  # both kinds in one batch
    for b, text in enumerate(texts):
        ids, labels, x = batch["input_ids"][b], batch["labels"][b], text["input_ids"]
        if kinds[b] == BLOCK_CAUSAL_ROW:  # SAT: every text token labelled at its predicting row's slot + 1
            shift, s1 = dar_layout(ids, t)
            assert 1 <= s1 <= t and ids[shift : shift + length].tolist() == x
            for p in range(1, length):
                assert labels[p + shift - t + 1] == x[p]
            assert int((labels != -100).sum()) == length - 1
        else:  # BERT: the text at slots [0, T), a label one slot after each masked token, nothing in dar's slots
            labelled = (labels != -100).nonzero().flatten() - 1
            assert 0 < len(labelled) <= round(0.3 * (length - 1)) + 1 and 0 not in labelled.tolist()
            for p in range(length):
                if p in labelled.tolist():
                    assert labels[p + 1] == x[p]
                else:
                    assert ids[p] == x[p]  # only the masked positions change
            assert (ids[labelled] == MASK).float().mean() > 0 or len(labelled) < 3
            assert (ids[length:] == PAD).all()
    again = collate(t, seed=1)
    assert all(torch.equal(batch[k], again[k]) for k in batch)


def test_the_mask_rule_per_row_kind_dense_flex_and_its_block_mask():
    """The mask_mod evaluated densely (create_mask) is the dense mask SDPA/eager get, and both are the rule written
    out: block-causal rows see their own and earlier groups of t slots, bidirectional rows their text. The BlockMask
    is assembled from the two family masks without create_block_mask, and FlexAttention's (unfused, CPU) output
    with it equals SDPA's with the dense mask."""
    from torch.nn.attention import flex_attention as flex

    t, width = 2, 132 + 2 * 2 - 2  # more than one 128-slot block, a partial one at the end
    text = masking.mixed_text_width(t, width)
    kind = torch.tensor([BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW, BIDIRECTIONAL_ROW, BLOCK_CAUSAL_ROW])
    q, k = torch.arange(width)[:, None], torch.arange(width)[None, :]
    rule = torch.stack([(k // t <= q // t) if kind_ == BLOCK_CAUSAL_ROW else (k < text).expand(width, width)
                        for kind_ in kind.tolist()])[:, None]
    dense = masking.mixed_rows_plan(kind, t, width).dense()
    from_mask_mod = flex.create_mask(masking.mixed_mask_mod(kind.int(), t, width), len(kind), 1, width, width,
                                     device="cpu")
    assert torch.equal(dense, rule) and torch.equal(from_mask_mod, rule)

    masking.family_block_masks(t, width, "cpu")  # once per shape; then no batch builds a BlockMask

    def no_build(*args, **kwargs):
        raise AssertionError("create_block_mask was called for a batch")

    original, flex.create_block_mask = flex.create_block_mask, no_build
    try:
        block_mask = masking.mixed_block_mask(kind, t, width)
        flipped = masking.mixed_block_mask(1 - kind, t, width)
    finally:
        flex.create_block_mask = original
    blocks_ = block_mask.to_dense().bool()  # (B, 1, q blocks, kv blocks): the blocks the kernel visits
    size = block_mask.BLOCK_SIZE[0]
    n = -(-width // size)
    padded = torch.nn.functional.pad(rule, (0, n * size - width, 0, n * size - width))
    any_in_block = padded.reshape(len(kind), 1, n, size, n, size).any(-1).any(-2)
    assert torch.equal(blocks_, any_in_block)
    assert torch.equal(flipped.to_dense().bool(), any_in_block[[1, 0, 0, 1]])  # every row takes the other kind

    query, key, value = (torch.randn(len(kind), 2, width, 8, generator=torch.Generator().manual_seed(i))
                         for i in range(3))
    # unfused on the CPU without compile (the full score matrix, masked); torch warns once per process, so the
    # warning is neither required nor shown
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = flex.flex_attention(query, key, value, block_mask=block_mask)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=dense)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("t", [2, 3])
def test_each_loss_reads_exactly_what_its_form_allows(t, impl, tiny_model):
    """A dar target: gradient from every token of an earlier group and the condition block, none from its own group
    or later. A masked row's target: gradient from every slot of its text, none from dar's slots after it. Rows
    never mix."""
    model = mixture_model(tiny_model, t, impl)
    length = 14
    batch = collate(t, batch=8, length=length, seed=2)
    kinds = batch["row_kind"]
    assert set(kinds.tolist()) == {BLOCK_CAUSAL_ROW, BIDIRECTIONAL_ROW}
    embeds = model.model.embed_tokens(batch["input_ids"]).detach().requires_grad_(True)
    log_probs = model(inputs_embeds=embeds, row_kind=kinds).logits.log_softmax(-1)
    checked = {BLOCK_CAUSAL_ROW: 0, BIDIRECTIONAL_ROW: 0}
    for b, j in (batch["labels"] != -100).nonzero().tolist():
        row, token = j - 1, batch["labels"][b, j]  # the causal LM's shift: row j - 1 predicts labels[j]
        reach = torch.autograd.grad(log_probs[b, row, token], embeds, retain_graph=True)[0].abs().sum(-1)
        assert (reach[torch.arange(len(reach)) != b] == 0).all()  # rows never mix
        if kinds[b] == BLOCK_CAUSAL_ROW:
            shift, s1 = dar_layout(batch["input_ids"][b], t)
            q = row + t - shift  # the text position of the target
            for p in range(1, length):
                assert (reach[b, p + shift] > 0) == (plan_rank(p, s1, t) < plan_rank(q, s1, t)), (b, q, p)
            assert (reach[b, :t] > 0).all()  # the condition block (BOS copies)
        else:
            assert (reach[b, :length] > 0).all() and (reach[b, length:] == 0).all(), b
        checked[int(kinds[b])] += 1
    assert checked[BLOCK_CAUSAL_ROW] == (length - 1) * int((kinds == BLOCK_CAUSAL_ROW).sum())
    assert checked[BIDIRECTIONAL_ROW] == int((batch["labels"][kinds == BIDIRECTIONAL_ROW] != -100).sum())


def test_the_loss_is_the_mean_over_both_kinds_of_targets(tiny_model):
    """One LM head, one cross-entropy: the model's loss is the mean of -log p over every label of both kinds."""
    t = 2
    model = mixture_model(tiny_model, t, "sdpa")
    batch = collate(t, batch=8, seed=3)
    out = model(**batch)
    log_probs = out.logits.log_softmax(-1)
    b, j = (batch["labels"] != -100).nonzero(as_tuple=True)
    want = -log_probs[b, j - 1, batch["labels"][b, j]].mean()
    torch.testing.assert_close(out.loss, want)
    prepared = model.prepare_attention(**batch)  # what a compiled step receives, built outside it
    torch.testing.assert_close(model(**batch, prepared_attention=prepared).loss, out.loss)




@torch.no_grad()
def test_flex_forward_equals_sdpa(static_flex_shapes, tiny_model):
    """FlexAttention has no CPU backward: its forward over the assembled BlockMask equals SDPA's (whose gradients
    the tests above audit)."""
    t = 2
    batch = collate(t, batch=8, seed=4)
    flex = mixture_model(tiny_model, t, "flex_attention")(input_ids=batch["input_ids"], row_kind=batch["row_kind"])
    sdpa = mixture_model(tiny_model, t, "sdpa")(input_ids=batch["input_ids"], row_kind=batch["row_kind"])
    torch.testing.assert_close(flex.logits, sdpa.logits, rtol=1e-5, atol=1e-5)


def test_what_the_one_stream_mixture_refuses(tiny_model):
    def args(**kw):
        return ObjectiveArguments(objective="mixture", **kw)

    with pytest.raises(ValueError, match="in one form"):
        args(mixture=["dar=1", "vmlm=1"], dar_form="single_stream")
    with pytest.raises(ValueError, match="one dar group size >= 2"):
        args(mixture=["dar=1", "vmlm=1"], dar_form="single_stream", masked_form="single_stream", group_size=[1])
    with pytest.raises(ValueError, match="needs dar"):
        args(mixture=["mlm=1", "vmlm=1"], masked_form="single_stream")
    with pytest.raises(ValueError, match=r"\['gvp'\] have no such form"):
        objectives.mixture.check_one_stream_mixture({"dar": 1, "gvp": 1}, {})
    collator = objectives.make_collator("mixture", ToyTokenizer(VOCAB), mixture=MIXTURE, components={"dar": {"t": 2}},
                                        form="single_stream")
    with pytest.raises(ValueError, match="rows of one length"):
        collator([{"input_ids": [BOS, 5, 6, 7]}, {"input_ids": [BOS, 5]}])
    with pytest.raises(ValueError, match="start with the BOS"):
        collator([{"input_ids": [5, 6, 7, 8]}])

    class NoMask(ToyTokenizer):
        mask_token_id = None

    with pytest.raises(ValueError, match="no mask token"):
        objectives.make_collator("mixture", NoMask(), mixture=MIXTURE, form="single_stream")
    causal = mixture_model(tiny_model, 2)
    with pytest.raises(ValueError, match="row_kind must have shape"):
        causal(input_ids=torch.tensor([[BOS, 5, 6, 7]]), row_kind=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="needs a block-causal config"):
        causal(input_ids=torch.tensor([[BOS, 5, 6, 7]]), attention_mask=torch.ones(1, 4), row_kind=torch.tensor([0]))


def test_pretrain_trains_it_and_the_checkpoint_loads_as_causal_and_masked_lm(tmp_path, bbc_text_dir):
    out = tmp_path / "run"
    code = cli_main([
        "pretrain", "--train_files", str(bbc_text_dir / "train.jsonl.gz"), "--train_tokenizer",
        "--tokenizer_vocab_size", "400", "--preset", "tiny", "--block_size", "32", "--objective", "mixture",
        "--mixture", "dar=0.5", "vmlm=0.5", "--group_size", "2", "--dar_form", "single_stream", "--masked_form",
        "single_stream", "--per_device_train_batch_size", "8", "--max_train_samples", "64", "--max_steps", "12",
        "--learning_rate", "3e-3", "--logging_steps", "1", "--do_train", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--save_strategy", "no", "--output_dir", str(out),
    ])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LookAroundForCausalLM"] and config["prediction_stream"] == "content"
    assert config["default_attention"] == "block_causal" and config["attention_group_size"] == 2
    losses = [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3])

    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForPreTraining, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(tok.bos_token + "The economy", return_tensors="pt", add_special_tokens=False).input_ids
    causal = AutoModelForCausalLM.from_pretrained(out)  # the dar half: t tokens per forward
    assert causal.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)
    masked = AutoModelForMaskedLM.from_pretrained(out).eval()  # the vmlm half: bidirectional over [MASK]
    filled = ids.clone()
    filled[0, 2] = tok.mask_token_id
    assert masked(input_ids=filled).logits.shape == (1, ids.shape[1], len(tok))
    # infilling reads the content stream bidirectionally over [MASK] inputs: what the vmlm rows trained
    from hf_lookaround.decoding.infill import infill

    result = infill(AutoModelForPreTraining.from_pretrained(out).eval(), tok, ["The economy[MASK][MASK] on Tuesday."],
                    steps=2, order="confidence")
    assert len(result.text) == 1 and tok.mask_token not in result.text[0] and "on Tuesday." in result.text[0]
