"""dar's one-stream form (SAT): block-causal attention, the row t places before a target predicts it.

Checked from the outside: the loss at each target has zero gradient from every token outside the groups before
its own and a non-zero gradient from every token inside them (the two-stream plan's conditioning set), on every
backend; decoding a group per forward gives the tokens of a brute-force re-forward; the command trains it; plain
token ids get a causal LM's next-token logits (the t layouts of the input), laid-out ones (`one_stream_layout=True`,
the Trainer's batches) each row's.
"""

import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.cli import main as cli_main
from hf_lookaround.models.lookaround.masking_lookaround import one_stream_start_rows
from hf_lookaround.objectives import dar
from hf_lookaround.training.pretraining import ObjectiveArguments
from conftest import BOS, EOS, PAD, ToyTokenizer

VOCAB = 61




def one_stream_model(tiny_model, t: int, impl: str = "eager", seed: int = 0, **overrides):
    return tiny_model(H.LookAroundForCausalLM, impl, seed=seed, default_attention="block_causal",
                      attention_group_size=t, prediction_stream="content", objective="dar", plan_params={"t": t},
                      **overrides)


def ragged_rows(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": [BOS] + rng.integers(4, VOCAB, n - 1).tolist()} for n in lengths]


def collate(t, lengths, seed=0):
    collator = objectives.make_collator("dar", ToyTokenizer(VOCAB), group_size=t, form="single_stream", seed=seed)
    return collator(ragged_rows(lengths, seed))


def layout_of(row: torch.Tensor, t: int):
    """(shift, s1) of one laid-out row: how many BOS copies stand before the text's BOS, and its first group."""
    leading = int((torch.cumprod((row == BOS).long(), 0)).sum())
    shift = leading - 1
    return shift, 2 * t - 1 - shift


def targets(batch, t):
    """(row, slot of the predicting row, x position p of the target, shift, s1) for every label."""
    found = []
    for b, j in (batch["labels"] != -100).nonzero().tolist():
        shift, s1 = layout_of(batch["input_ids"][b], t)
        found.append((b, j - 1, j + t - 1 - shift, shift, s1))
    return found


def plan_rank(p, s1, t):
    """The two-stream plan's rank of text position p (>= 1) after BOS (rank 0)."""
    return 0 if p == 0 else int(dar.ranks(np.array(p - 1), s1, t, 1))


@pytest.mark.parametrize("t", [2, 3])
def test_the_layout_puts_every_group_in_one_block_and_labels_each_target_once(t):
    lengths = [14, 9, 14, 5, 2]
    batch = collate(t, lengths, seed=1)
    rows = ragged_rows(lengths, seed=1)
    assert set(batch) == {"input_ids", "labels"}  # no attention mask: one mask for every batch
    assert batch["input_ids"].shape == (5, max(lengths) + 2 * t - 2)
    for b, row in enumerate(rows):
        shift, s1 = layout_of(batch["input_ids"][b], t)
        assert shift == one_stream_start_rows(t, s1) and 1 <= s1 <= t
        n = len(row["input_ids"])
        assert batch["input_ids"][b, shift : shift + n].tolist() == row["input_ids"]
        for p in range(1, n):  # every text token is a target, in the block after its predicting row's
            slot = p + shift
            assert batch["labels"][b, slot - t + 1] == row["input_ids"][p]
            assert slot // t == plan_rank(p, s1, t)  # block = the plan's rank (block 0: the condition)
        assert (batch["labels"][b] != -100).sum() == n - 1


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("t", [2, 3])
def test_each_target_reads_exactly_the_earlier_groups(t, impl, tiny_model):
    """Zero gradient from every token of the target's group and later; non-zero from every token of an earlier
    group, and from the condition block."""
    model = one_stream_model(tiny_model, t, impl)
    batch = collate(t, [14, 9, 14, 5], seed=2)
    embeds = model.model.embed_tokens(batch["input_ids"]).detach().requires_grad_(True)
    log_probs = model(inputs_embeds=embeds, one_stream_layout=True).logits.log_softmax(-1)
    checked = 0
    for b, row, q, shift, s1 in targets(batch, t):
        token = batch["labels"][b, row + 1]
        grad = torch.autograd.grad(log_probs[b, row, token], embeds, retain_graph=True)[0]
        reach = grad.abs().sum(-1)  # (B, W)
        assert (reach[torch.arange(len(reach)) != b] == 0).all()  # rows never mix
        n = int((batch["labels"][b] != -100).sum()) + 1
        for p in range(1, n):
            must = plan_rank(p, s1, t) < plan_rank(q, s1, t)
            assert (reach[b, p + shift] > 0) == must, (b, q, p, t)
        assert (reach[b, :t] > 0).all()  # the condition block (BOS copies) is read by every target
        assert (reach[b, shift + n :] == 0).all()  # padding after the row is never read
        checked += 1
    assert checked == 13 + 8 + 13 + 4


@torch.no_grad()
def test_flex_forward_ignores_what_a_target_must_not_see(static_flex_shapes, tiny_model):
    """FlexAttention has no CPU backward: the same rule by perturbing the tokens a target must not see."""
    t = 2
    model = one_stream_model(tiny_model, t, "flex_attention")
    batch = collate(t, [14, 14, 14], seed=3)
    base = model(input_ids=batch["input_ids"], one_stream_layout=True).logits
    sdpa = one_stream_model(tiny_model, t, "sdpa")(input_ids=batch["input_ids"], one_stream_layout=True).logits
    torch.testing.assert_close(base, sdpa, rtol=1e-5, atol=1e-5)
    for b, row, q, shift, s1 in targets(batch, t)[5::9]:
        later = [p + shift for p in range(1, 14) if plan_rank(p, s1, t) >= plan_rank(q, s1, t)]
        changed = batch["input_ids"].clone()
        changed[b, later] = (changed[b, later] + 7) % (VOCAB - 4) + 4
        torch.testing.assert_close(model(input_ids=changed, one_stream_layout=True).logits[b, row], base[b, row],
                                   rtol=0, atol=1e-6)
        earlier = [p + shift for p in range(1, 14) if plan_rank(p, s1, t) < plan_rank(q, s1, t)]
        if earlier:
            changed[b, earlier] = (changed[b, earlier] + 3) % (VOCAB - 4) + 4
            assert (model(input_ids=changed, one_stream_layout=True).logits[b, row] - base[b, row]).abs().max() > 1e-4


def brute_force_decode(model, prompt: list[int], t: int, new_tokens: int) -> list[int]:
    """Greedy, one full forward per group over the laid-out sequence: the rows of the last block predict."""
    text = len(prompt) - 1
    s1 = (text - 1) % t + 1
    seq = [BOS] * one_stream_start_rows(t, s1) + list(prompt)
    out = []
    while len(out) < new_tokens:
        assert len(seq) % t == 0
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq]), one_stream_layout=True).logits[0, -t:]
        group = logits.argmax(-1).tolist()[: new_tokens - len(out)]
        out += group
        seq += group
    return out


@pytest.mark.parametrize("t", [2, 3])
def test_group_decoding_equals_a_brute_force_reforward(t, tiny_model):
    model = one_stream_model(tiny_model, t, "sdpa", seed=4)
    model.generation_config.pad_token_id = PAD
    prompts = [[BOS, 5, 9, 11, 7, 30], [BOS, 8], [BOS, 12, 13, 14, 15]]
    want = [brute_force_decode(model, p, t, 7) for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    for kwargs in ({}, {"use_cache": False}, {"cache_implementation": "static"}):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, eos_token_id=[],
                             **kwargs)
        assert out[:, :width].tolist() == ids.tolist()
        assert out[:, width:].tolist() == want, kwargs
    one = model.generate(ids[1:2, width - 2 :], max_new_tokens=7, do_sample=False, eos_token_id=[])
    assert one[0, 2:].tolist() == want[1]  # unpadded, and without group_size: t is the default


def test_it_refuses_what_it_cannot_do(tiny_model):
    with pytest.raises(ValueError, match="one group size"):
        ObjectiveArguments(objective="dar", group_size=[1, 2], dar_form="single_stream")
    with pytest.raises(ValueError, match="start with the BOS"):
        collator = objectives.make_collator("dar", ToyTokenizer(VOCAB), group_size=2, form="single_stream")
        collator([{"input_ids": [5, 6, 7, 8]}])
    model = one_stream_model(tiny_model, 2)
    with pytest.raises(ValueError, match="group_size=2 only"):
        model.generate(torch.tensor([[BOS, 5, 6]]), group_size=3, max_new_tokens=3)
    with pytest.raises(ValueError, match="self-speculative"):
        model.generate(torch.tensor([[BOS, 5, 6]]), draft_group_size=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="start with the BOS"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)


def test_pretrain_trains_and_saves_a_causal_lm_that_decodes_groups(tmp_path, bbc_text_dir, capsys):
    out = tmp_path / "run"
    code = cli_main([
        "pretrain", "--train_files", str(bbc_text_dir / "train.jsonl.gz"), "--train_tokenizer",
        "--tokenizer_vocab_size", "400", "--preset", "tiny", "--block_size", "32", "--objective", "dar",
        "--group_size", "2", "--dar_form", "single_stream", "--per_device_train_batch_size", "4",
        "--max_train_samples", "16", "--max_steps", "3", "--do_train", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--output_dir", str(out),
    ])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["default_attention"] == "block_causal" and config["attention_group_size"] == 2
    assert config["prediction_stream"] == "content" and config["architectures"] == ["LookAroundForCausalLM"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(tok.bos_token + "The economy", return_tensors="pt", add_special_tokens=False).input_ids
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 6)
    # the command decodes through the causal LM's content stream, t tokens a forward, the same tokens
    capsys.readouterr()
    assert cli_main(["generate", str(out), "--prompt", "The economy", "--max_new_tokens", "6", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["mode"].startswith("one stream, 2 tokens per forward")
    assert printed["outputs"] == [tok.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)]
    # perplexity's --max_length leaves room for the layout's 2t - 1 start rows: a one-line error that says the limit
    limit = config["max_position_embeddings"] - 3
    argv = ["perplexity", "--model_name_or_path", str(out), "--dataset", str(bbc_text_dir / "train.jsonl.gz"),
            "--protocol", "ar", "--max_documents", "1", "--stride", "16", "--output_dir", str(tmp_path / "ppl")]
    capsys.readouterr()
    assert cli_main([*argv, "--max_length", str(limit + 1)]) == 2
    assert f"use --max_length {limit} or less" in capsys.readouterr().err


@pytest.mark.parametrize("t", [2, 3])
def test_ar_perplexity_scores_each_token_from_all_tokens_before_it(t, tiny_model, tokenizer, bbc_text_dir):
    """p(x_k | x_<k) of the one-stream form, against a brute force: for each k, the prefix x_<k laid out as a
    prompt (its groups ending at x_(k-1)); the first of its last t rows predicts x_k."""
    from hf_lookaround.data.text import load_texts
    from hf_lookaround.evaluation.perplexity import ar_perplexity, sliding_windows

    model = one_stream_model(tiny_model, t, "sdpa", seed=5, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    text = load_texts(bbc_text_dir / "validation.jsonl.gz")[0][:160]
    # windows of 24 with stride 12: later windows start mid-document and get a BOS in front
    result = ar_perplexity(model, tokenizer, [text], max_length=24, stride=12, batch_size=2)
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False).input_ids
    assert result.extra["ar_mode"] == "one_stream_groups" and result.num_tokens == len(ids) - 1
    want = []
    for window in sliding_windows(ids, 24, 12, has_bos=True):  # the windows themselves are not under test
        context = window.input_ids if window.offset else [tokenizer.bos_token_id, *window.input_ids]
        lead = len(context) - len(window.input_ids)
        for k in range(window.first_scored + lead, len(context)):
            prefix = context[:k]
            s1 = (len(prefix) - 2) % t + 1
            seq = [tokenizer.bos_token_id] * one_stream_start_rows(t, s1) + prefix
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq]), one_stream_layout=True).logits[0, -t]
            want.append(-torch.log_softmax(logits, -1)[context[k]].item())
    assert np.allclose(result.nlls, want, atol=1e-4)


def test_decoding_streams_stops_at_eos_and_samples_reproducibly(tiny_model):
    """The one-stream decoder goes through the same writes as the two-stream one: streamers see every token once,
    a row stops after EOS (padding after it), and sampling with a seed repeats itself."""
    t = 2
    model = one_stream_model(tiny_model, t, "sdpa", seed=6)
    model.generation_config.pad_token_id = PAD
    prompt = torch.tensor([[BOS, 5, 9, 11]])
    greedy = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=[])[0, 4:].tolist()

    class Collect:
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value.flatten().tolist())

        def end(self):
            self.seen.append("end")

    streamer = Collect()
    model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=[], streamer=streamer)
    assert streamer.seen[0] == prompt[0].tolist() and streamer.seen[-1] == "end"
    assert sum(streamer.seen[1:-1], []) == greedy and all(len(g) == t for g in streamer.seen[1:-1])
    eos = greedy[2]  # the third new token (the first of the second group) as EOS: the row ends there
    stopped = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=eos)[0, 4:].tolist()
    assert stopped[: greedy.index(eos) + 1] == greedy[: greedy.index(eos) + 1]
    assert all(token == PAD for token in stopped[greedy.index(eos) + 1 :])
    torch.manual_seed(0)
    first = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=5, eos_token_id=[])
    torch.manual_seed(0)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=5, eos_token_id=[]), first)


def brute_force_next_token_log_probs(model, row: list[int], t: int) -> torch.Tensor:
    """log p(row[i + 1] | row[<= i]) for every i: each prefix laid out as a prompt on its own (a BOS in front if
    the row has none); the first of its last t rows predicts the next token. (len(row) - 1, V)"""
    from hf_lookaround.decoding import one_stream_prompt

    sequence = row if row[0] == BOS else [BOS, *row]
    lead = len(sequence) - len(row)
    out = []
    for i in range(len(row) - 1):
        prefix = torch.tensor([sequence[: i + 1 + lead]])
        ids, _, _ = one_stream_prompt(prefix, torch.ones_like(prefix), t, BOS, PAD)
        with torch.no_grad():
            out.append(model(input_ids=ids, one_stream_layout=True).logits[0, -t].log_softmax(-1))
    return torch.stack(out)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("t", [2, 3])
def test_plain_token_ids_get_the_next_token_logits_of_a_causal_lm(t, padding, tiny_model):
    """The causal LM contract on plain ids (what lm-evaluation-harness and any AutoModelForCausalLM caller pass):
    logits[:, i] = log p(x_(i+1) | x_<=i), equal to a brute force per position, for rows with and without a
    leading BOS, left- or right-padded; with labels, the mean NLL of the next tokens."""
    model = one_stream_model(tiny_model, t, "sdpa", seed=7, max_position_embeddings=64)
    rng = np.random.default_rng(7)
    rows = [[BOS, *rng.integers(4, VOCAB, 11).tolist()], rng.integers(4, VOCAB, 12).tolist(),
            [BOS, *rng.integers(4, VOCAB, 5).tolist()]]
    width = max(map(len, rows))
    ids, mask = torch.full((len(rows), width), PAD), torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        columns = slice(0, len(row)) if padding == "right" else slice(width - len(row), width)
        ids[b, columns], mask[b, columns] = torch.tensor(row), 1
    with torch.no_grad():
        log_probs = model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)
    for b, row in enumerate(rows):
        first = 0 if padding == "right" else width - len(row)
        want = brute_force_next_token_log_probs(model, row, t)
        torch.testing.assert_close(log_probs[b, first : first + len(row) - 1], want, rtol=0, atol=1e-5)
    one = torch.tensor([rows[1]])
    with torch.no_grad():
        out = model(input_ids=one, labels=one)
    want = brute_force_next_token_log_probs(model, rows[1], t)
    torch.testing.assert_close(out.logits[0, :-1].log_softmax(-1), want, rtol=0, atol=1e-5)
    nll = -want.gather(1, one[0, 1:, None]).mean()
    torch.testing.assert_close(out.loss, nll, rtol=0, atol=1e-5)


def test_the_causal_view_refuses_what_it_cannot_take(tiny_model):
    model = one_stream_model(tiny_model, 2, max_position_embeddings=16)
    assert model.config.n_positions == 16 - 3  # start rows (up to 2t - 2) and a BOS in front
    ids = torch.tensor([[BOS, 5, 6, 7]])
    with pytest.raises(ValueError, match="input_ids .* only, not inputs_embeds"):
        model(inputs_embeds=model.model.embed_tokens(ids))
    with pytest.raises(ValueError, match="not past_key_values, use_cache"):
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    with pytest.raises(ValueError, match="one run of real tokens"):
        model(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="more than this checkpoint's causal view takes"):
        model(input_ids=torch.full((1, 14), 5))
    assert model(input_ids=torch.full((1, 13), 5)).logits.shape == (1, 13, VOCAB)
    ar = tiny_model(H.LookAroundForCausalLM, default_attention="causal", prediction_stream="content")
    with pytest.raises(ValueError, match="one_stream_layout=True is for dar's one-stream form"):
        ar(input_ids=ids, one_stream_layout=True)


def test_the_pretraining_trainer_passes_the_collators_layout(tmp_path, tiny_model):
    """Training reads the collator's batch as the layout it is: the Trainer's loss is the layout's."""
    from transformers import TrainingArguments

    from hf_lookaround.training.pretraining import LookAroundTrainer

    model = one_stream_model(tiny_model, 2).train()
    batch = collate(2, [14, 9, 14, 5], seed=8)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    loss = LookAroundTrainer(model=model, args=args).compute_loss(model, dict(batch))
    torch.testing.assert_close(loss, model(**batch, one_stream_layout=True).loss)
    assert not torch.allclose(loss, model(**batch).loss)  # the same ids read as plain text: another loss
