"""Decoding with the streams: group decoding and any-order infilling against brute-force references."""

import copy
import json
import logging
import re

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, pipeline

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM, LookAroundForMaskedLM, LookAroundForPreTraining
from hf_lookaround.decoding import GroupDecodingMixin, UntrainedDecodingError, group_generate, semi_ar_ranks
from hf_lookaround.decoding.infill import commit_schedule, infill
from hf_lookaround.cli.generate import main
from hf_lookaround.objectives.ar import plan as autoregressive_plan
from hf_lookaround.data.tokenization import train_tokenizer

CORPUS = [
    "The committee met on Tuesday and agreed that the budget would be revised before spring.",
    "the of and to in a is that for it as was with be by on not he",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS * 5, vocab_size=300, min_frequency=1)


def _config(tokenizer, objective="dar", plan_params=None, **kw):
    # initializer_range 0.2: a random model at the usual 0.02 emits one token forever, which proves little
    kw.setdefault("initializer_range", 0.2)
    return LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=48, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id, objective=objective,
        plan_params={"t": [1, 2, 3]} if plan_params is None and objective == "dar" else plan_params, **kw,
    )


def _model(cls, tokenizer, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(_config(tokenizer, **kw)).eval()


@pytest.fixture(scope="module")
def dar(tokenizer):
    return _model(LookAroundForPreTraining, tokenizer)


@pytest.fixture(scope="module")
def mlm(tokenizer):
    return _model(LookAroundForPreTraining, tokenizer, seed=1, objective="mlm", plan_params={"mask_ratio": 0.15})


def _causal(pretraining):
    causal = LookAroundForCausalLM(pretraining.config).eval()
    causal.load_state_dict(pretraining.state_dict())
    return causal


def _prompt(tokenizer, text="The committee met on"):
    return [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]


def _reference_ranks(prompt_len, total, t):
    """Semi-AR ranks built group by group: BOS rank 0, prompt groups ending at the prompt's end, then groups of t."""
    text = prompt_len - 1
    first = (text - 1) % t + 1 if text else 0
    ranks, rank, filled = [0], 0, 0
    sizes = ([first] if first else []) + [t] * total
    for size in sizes:
        rank += 1
        ranks += [rank] * size
        filled += size
        if len(ranks) >= total:
            break
    return ranks[:total]


# ----------------------------------------------------------------------------------------------
# group decoding
# ----------------------------------------------------------------------------------------------
def test_ranks_are_a_semi_ar_plan_ending_at_the_prompt():
    for prompt_len in (1, 2, 5, 6):
        for t in (1, 2, 3, 4):
            mask = torch.ones(1, prompt_len, dtype=torch.long)
            ranks, positions = semi_ar_ranks(mask, prompt_len + 9, t, torch.tensor([True]))
            assert ranks[0].tolist() == _reference_ranks(prompt_len, prompt_len + 9, t), (prompt_len, t)
            assert positions[0].tolist() == list(range(prompt_len + 9))
    # t = 1 is the AR plan (with BOS as the condition token)
    mask = torch.ones(1, 5, dtype=torch.long)
    assert torch.equal(semi_ar_ranks(mask, 12, 1, torch.tensor([True]))[0], autoregressive_plan([12], 12).group_ids)
    # left padding shifts ranks and positions of a row, nothing else
    padded = torch.tensor([[0, 0, 1, 1, 1]])
    ranks, positions = semi_ar_ranks(padded, 10, 2, torch.tensor([True]))
    unpadded, _ = semi_ar_ranks(torch.ones(1, 3, dtype=torch.long), 8, 2, torch.tensor([True]))
    assert torch.equal(ranks[0, 2:], unpadded[0]) and positions[0, 2:].tolist() == list(range(8))


def _greedy_reference(model, prompt, new_tokens):
    """Token-by-token greedy decoding through the query stream, recomputing the whole prefix with the AR plan."""
    seq = list(prompt)
    for _ in range(new_tokens):
        ids = torch.tensor([seq + [0]])  # the slot's content is never seen: the query at L reads ranks < L
        group_ids = autoregressive_plan([len(seq) + 1], len(seq) + 1).group_ids
        logits = model(input_ids=ids, group_ids=group_ids, target_positions=torch.tensor([[len(seq)]])).logits
        seq.append(int(logits[0, 0].argmax()))
    return seq


@pytest.mark.parametrize("use_cache", [True, False])
def test_t1_is_greedy_token_by_token_decoding_through_the_query_stream(dar, tokenizer, use_cache):
    prompt = _prompt(tokenizer)
    expected = _greedy_reference(dar, prompt, 12)
    got = group_generate(dar, prompt, group_size=1, max_new_tokens=12, eos_token_id=[], use_cache=use_cache)
    assert got[0].tolist() == expected
    # the same through generate(group_size=1) on the causal head (custom_generate hook), and through the head's
    # own token-by-token generate() (no group_size), which reads the query stream of a two-stream checkpoint
    causal = _causal(dar)
    assert isinstance(causal, GroupDecodingMixin)
    for kwargs in ({"group_size": 1}, {}):
        out = causal.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, use_cache=use_cache,
                              eos_token_id=None, **kwargs)
        assert out[0].tolist() == expected, kwargs


@pytest.mark.parametrize("t", [2, 3])
def test_cached_group_decoder_matches_recomputing_the_prefix(dar, tokenizer, t):
    prompt = _prompt(tokenizer, "agreed that the budget")
    new = 11  # not a multiple of t: the last group is cut
    out = group_generate(dar, prompt, group_size=t, max_new_tokens=new, eos_token_id=[], use_cache=True,
                         return_dict_in_generate=True, output_logits=True)
    seq = out.sequences[0].tolist()
    assert len(seq) == len(prompt) + new and len(out.logits) == new
    ranks = _reference_ranks(len(prompt), len(seq), t)
    start = len(prompt)
    while start < len(seq):
        width = min(t, len(seq) - start)
        # whole prefix, content of the group being predicted hidden (invalid keys), query rows at the group
        ids = torch.tensor([seq[:start] + [0] * width])
        mask = torch.tensor([[1] * start + [0] * width])
        logits = dar(input_ids=ids, attention_mask=mask, group_ids=torch.tensor([ranks[: start + width]]),
                     target_positions=torch.arange(start, start + width)[None]).logits[0]
        for j in range(width):
            torch.testing.assert_close(out.logits[start - len(prompt) + j][0], logits[j], atol=1e-5, rtol=0)
            assert seq[start + j] == int(logits[j].argmax())
        start += width


def test_left_padded_batch_gives_the_tokens_of_single_rows(dar, tokenizer):
    prompts = [_prompt(tokenizer, "The committee met on"), _prompt(tokenizer, "budget"), _prompt(tokenizer, "it was")]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    for t in (1, 2):
        batch = group_generate(dar, ids, mask, group_size=t, max_new_tokens=9, eos_token_id=[],
                               return_dict_in_generate=True, output_logits=True)
        for b, p in enumerate(prompts):
            single = group_generate(dar, p, group_size=t, max_new_tokens=9, eos_token_id=[],
                                    return_dict_in_generate=True, output_logits=True)
            assert batch.sequences[b, width:].tolist() == single.sequences[0, len(p):].tolist()
            for a, s in zip(batch.logits, single.logits):
                torch.testing.assert_close(a[b], s[0], atol=1e-5, rtol=0)


def test_eos_stops_each_row_and_pads_the_rest(dar, tokenizer):
    prompts = [_prompt(tokenizer, "The committee"), _prompt(tokenizer, "agreed that")]
    free = [group_generate(dar, p, group_size=2, max_new_tokens=10, eos_token_id=[])[0, len(p):].tolist()
            for p in prompts]
    # pick as EOS a token that row 0 emits (at index k) and row 1 never does
    k, eos = next((k, tok) for k, tok in enumerate(free[0]) if k >= 1 and tok not in free[1] and tok not in free[0][:k])
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = group_generate(dar, ids, mask, group_size=2, max_new_tokens=10, eos_token_id=eos, pad_token_id=pad)
    row0, row1 = out[0, width:].tolist(), out[1, width:].tolist()
    assert row0[: k + 1] == free[0][: k + 1] and all(tok == pad for tok in row0[k + 1 :])
    assert row1 == free[1][: len(row1)] and len(row1) == 10  # row 1 never finished: the batch ran to the end
    # a single row that finished stops the loop: the sequence ends at the group holding EOS
    alone = group_generate(dar, prompts[0], group_size=2, max_new_tokens=10, eos_token_id=eos)
    assert alone[0, len(prompts[0]) :].tolist()[: k + 1] == free[0][: k + 1]
    assert alone.shape[1] - len(prompts[0]) == min(10, (k // 2 + 1) * 2)


def test_logits_processors_and_sampling_controls(dar, tokenizer):
    class Ban(LogitsProcessor):
        def __init__(self, banned):
            self.banned = banned

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, self.banned] = -float("inf")
            return scores

    prompt = _prompt(tokenizer)
    free = group_generate(dar, prompt, group_size=2, max_new_tokens=8, eos_token_id=[])[0, len(prompt):].tolist()
    banned = free[0]
    out = group_generate(dar, prompt, group_size=2, max_new_tokens=8, eos_token_id=[],
                         logits_processor=LogitsProcessorList([Ban(banned)]))
    assert banned not in out[0, len(prompt):].tolist()
    # top_k=1 sampling is greedy; a fixed generator makes sampling reproducible
    top1 = group_generate(dar, prompt, group_size=2, max_new_tokens=8, eos_token_id=[], do_sample=True, top_k=1,
                          generator=torch.Generator().manual_seed(3))
    assert top1[0, len(prompt):].tolist() == free
    draws = [group_generate(dar, [prompt] * 4, group_size=2, max_new_tokens=8, eos_token_id=[], do_sample=True,
                            temperature=2.0, top_p=0.95, generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    with pytest.raises(ValueError, match="do_sample"):
        group_generate(dar, prompt, group_size=2, max_new_tokens=4, temperature=0.7)
    # a processor that reads the sequence runs slot by slot, through generate() as through group_generate
    causal = _causal(dar)
    penalised = causal.generate(torch.tensor([prompt]), group_size=2, max_new_tokens=8, repetition_penalty=5.0,
                                eos_token_id=None)
    by_hand = group_generate(dar, prompt, group_size=2, max_new_tokens=8, eos_token_id=[],
                             logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(5.0)]))
    assert torch.equal(penalised, by_hand) and penalised[0, len(prompt):].tolist() != free


def test_t1_sampling_draws_what_token_by_token_sampling_draws(dar, tokenizer):
    """Same seed, same warpers: group decoding at t = 1 consumes the RNG as transformers' sampling loop does."""
    causal = _causal(dar)
    prompt = torch.tensor([_prompt(tokenizer)] * 3)
    draws = []
    for kwargs in ({"group_size": 1}, {}):
        torch.manual_seed(11)
        draws.append(causal.generate(prompt, max_new_tokens=10, do_sample=True, top_k=40, top_p=0.9,
                                     eos_token_id=None, **kwargs))
    assert torch.equal(draws[0], draws[1])


def test_generate_and_text_generation_pipeline(dar, tokenizer, caplog):
    causal = _causal(dar)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"
    # BOS written into the text, no special tokens added: the same ids as the default encoding (<s> + text)
    prompt_text = "<s>The committee met on"
    enc = tokenizer(prompt_text, add_special_tokens=False, return_tensors="pt")
    direct = causal.generate(**enc, group_size=2, max_new_tokens=7, do_sample=False, eos_token_id=None)
    expected = group_generate(dar, enc["input_ids"], group_size=2, max_new_tokens=7, eos_token_id=[])
    assert torch.equal(direct, expected)
    pipe = pipeline("text-generation", model=causal, tokenizer=tokenizer)
    result = pipe(prompt_text, group_size=2, max_new_tokens=7, do_sample=False, eos_token_id=None,
                  return_full_text=False, add_special_tokens=False)
    assert result[0]["generated_text"] == tokenizer.decode(expected[0, enc["input_ids"].shape[1]:])
    # the pipeline's default encoding is <s> + text, without EOS (tests/test_generation_features.py checks that
    # an older tokenizer's <s> ... </s> prompt is warned about)
    with caplog.at_level(logging.WARNING, logger="hf_lookaround.models.lookaround.generation_lookaround"):
        default = pipe("The committee met on", group_size=2, max_new_tokens=7, do_sample=False, eos_token_id=None,
                       return_full_text=False)
    assert default == result and "ends with the EOS token" not in caplog.text
    # several sequences per prompt, sampled
    out = causal.generate(**enc, group_size=2, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    assert out.shape == (3, enc["input_ids"].shape[1] + 5)
    with pytest.raises(ValueError, match="beam"):
        causal.generate(**enc, group_size=2, max_new_tokens=4, num_beams=2)


def _pipeline_warnings(model, tokenizer) -> list[str]:
    """What transformers logs (from its first call on: warning_once's memory is cleared) over two calls of the
    text-generation pipeline on ``model``, each message up to its first ``=`` (the values and sets differ)."""
    import io

    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # "Passing `generation_config` together with ..." is a warning_once
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("transformers").addHandler(handler)
    try:
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        for _ in range(2):
            pipe("The committee met on", max_new_tokens=4, do_sample=False)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    return sorted(line.split("=")[0] for line in stream.getvalue().splitlines() if "generat" in line or "max_" in line)


def test_the_text_generation_pipeline_warns_no_more_than_for_a_plain_gpt2(tokenizer):
    """Issue 43: transformers 5.17's pipeline warns "Both `max_new_tokens` and `max_length` seem to have been set"
    (every call) and "Passing `generation_config` together with generation-related arguments" (once) for a plain
    GPT-2 too; a LookAround causal LM (its generate() is GroupDecodingMixin's) must add nothing to them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=48, n_embd=32, n_layer=1, n_head=2,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)).eval()
    plain = _pipeline_warnings(gpt2, tokenizer)
    # what the comparison is against: both warnings the fault hunt saw, for GPT-2
    assert any("Both `max_new_tokens`" in line for line in plain) and any("Passing `generation_config`" in line
                                                                          for line in plain), plain
    for model in (_model(LookAroundForCausalLM, tokenizer, objective="ar"),
                  _causal(_model(LookAroundForPreTraining, tokenizer))):  # ar, and dar's group decoding
        assert _pipeline_warnings(model, tokenizer) == plain


def test_group_size_the_checkpoint_was_not_trained_for(tokenizer, caplog):
    model = _model(LookAroundForPreTraining, tokenizer, objective="dar", plan_params={"t": 2})
    prompt = _prompt(tokenizer)
    with pytest.raises(UntrainedDecodingError, match="group_size=4 was not trained.*allow_untrained"):
        group_generate(model, prompt, group_size=4, max_new_tokens=4)
    with caplog.at_level(logging.WARNING, logger="hf_lookaround.models.lookaround.decoding_lookaround"):
        out = group_generate(model, prompt, group_size=4, max_new_tokens=4, allow_untrained=True)
    assert out.shape[1] == len(prompt) + 4 and "decoding anyway" in caplog.text
    masked = _model(LookAroundForPreTraining, tokenizer, objective="mlm", plan_params={"mask_ratio": 0.15})
    with pytest.raises(UntrainedDecodingError, match="infill"):
        group_generate(masked, prompt, group_size=1, max_new_tokens=4)
    single_stream = _model(LookAroundForPreTraining, tokenizer, objective=None, prediction_stream="content")
    with pytest.raises(UntrainedDecodingError, match="query stream.*never trained"):
        group_generate(single_stream, prompt, group_size=1, max_new_tokens=4)


def test_group_decoding_errors(dar, tokenizer):
    prompt = _prompt(tokenizer)
    with pytest.raises(ValueError, match="max_position_embeddings=48"):
        group_generate(dar, list(range(5, 55)), group_size=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens.*max_position_embeddings"):
        group_generate(dar, prompt, group_size=2, max_new_tokens=48)
    with pytest.raises(ValueError, match="left padding"):
        group_generate(dar, torch.tensor([prompt]), torch.tensor([[1] * (len(prompt) - 1) + [0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        group_generate(dar, prompt, group_size=0, max_new_tokens=2)


# ----------------------------------------------------------------------------------------------
# infilling
# ----------------------------------------------------------------------------------------------
def test_commit_schedule():
    for schedule in ("cosine", "linear"):
        for n, steps in ((1, 1), (7, 3), (12, 12), (20, 6)):
            counts = commit_schedule(n, steps, schedule)
            assert sum(counts) == n and len(counts) == steps and all(c >= 1 for c in counts[: n])
    assert commit_schedule(8, 8, "linear") == [1] * 8
    cosine = commit_schedule(100, 10, "cosine")
    assert cosine[0] < cosine[-2]  # few commits first, while context is scarce (MaskGIT)


@pytest.mark.parametrize("order", ["confidence", "random", "left_to_right"])
def test_infilling_never_changes_a_visible_token(mlm, tokenizer, order):
    rows = [_prompt(tokenizer, "The committee met on Tuesday and agreed"), _prompt(tokenizer, "the budget would")]
    pad = tokenizer.pad_token_id
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # row 1 is right-padded
    hidden = torch.zeros_like(ids, dtype=torch.bool)
    hidden[0, [1, 3, 4, width - 1]] = True
    hidden[1, [2, 5]] = True
    out = infill(mlm, tokenizer, ids, hidden, attention_mask=mask, steps=3, order=order, do_sample=True,
                 temperature=1.5, seed=0)
    assert torch.equal(out.sequences[~hidden], ids[~hidden])
    assert (out.commit_step[hidden] >= 1).all() and (out.commit_step[~hidden] == 0).all()
    assert out.num_steps == int(out.commit_step.max()) <= 3


def test_left_to_right_infilling_is_the_masked_prefix_protocol(mlm, tokenizer):
    """S = number of hidden positions, left to right, greedy: step k predicts position k from the visible prefix
    alone (BOS rank 0, prefix rank 1, k rank 2, nothing after k), the masked-prefix protocol of
    evaluation/perplexity.py."""
    prompt = _prompt(tokenizer, "The committee met")
    n = 7
    out = infill(mlm, tokenizer, torch.tensor(prompt), num_tokens=n, order="left_to_right", steps=n)
    seq = list(prompt)
    for k in range(len(prompt), len(prompt) + n):
        ids = torch.tensor([seq + [0]])
        group_ids = torch.ones_like(ids)
        group_ids[0, 0], group_ids[0, k] = 0, 2
        logits = mlm(input_ids=ids, group_ids=group_ids, target_positions=torch.tensor([[k]])).logits[0, 0]
        seq.append(int(logits.argmax()))
    assert out.sequences[0].tolist() == seq
    assert out.commit_step[0, len(prompt):].tolist() == list(range(1, n + 1))


def test_infill_from_a_mask_marked_string_and_unconditional(mlm, tokenizer):
    text = "The committee[MASK] on Tuesday and[MASK][MASK] the budget"
    out = infill(mlm, tokenizer, text, steps=2)
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    hidden = torch.tensor(ids) == tokenizer.mask_token_id
    assert int(hidden.sum()) == 3 and out.num_steps == 2
    assert torch.equal(out.sequences[0][~hidden], torch.tensor(ids)[~hidden])
    assert not (out.sequences == tokenizer.mask_token_id).any() and isinstance(out.text, str)
    free = infill(mlm, tokenizer, num_tokens=9, do_sample=True, top_k=20, seed=1)
    assert free.sequences.shape == (1, 10) and free.sequences[0, 0] == tokenizer.bos_token_id
    again = infill(mlm, tokenizer, num_tokens=9, do_sample=True, top_k=20, seed=1)
    other = infill(mlm, tokenizer, num_tokens=9, do_sample=True, top_k=20, seed=2)
    assert torch.equal(free.sequences, again.sequences) and not torch.equal(free.sequences, other.sequences)


def test_single_stream_masked_checkpoint_fills_through_mask_inputs(tokenizer):
    model = _model(LookAroundForMaskedLM, tokenizer, seed=2, objective="mlm", plan_params={"mask_ratio": 0.15},
                   prediction_stream="content")
    ids = torch.tensor([_prompt(tokenizer, "The committee met on Tuesday")])
    hidden = torch.zeros_like(ids, dtype=torch.bool)
    hidden[0, [2, 4]] = True
    out = infill(model, tokenizer, ids, hidden, steps=1)
    masked = torch.where(hidden, tokenizer.mask_token_id, ids)
    expected = model(input_ids=masked).logits.argmax(-1)
    assert torch.equal(out.sequences[hidden], expected[hidden])


def test_semi_ar_blocks_fill_left_to_right_in_steps_per_block(mlm, tokenizer):
    """LLaDA's semi-AR infilling: hidden positions in blocks of L, left to right, S steps each; a block commits
    only its own positions, all of them before the next block starts."""
    prompt = _prompt(tokenizer, "The committee met")
    n, length, steps = 10, 4, 2  # blocks of 4, 4 and 2 hidden positions
    out = infill(mlm, tokenizer, torch.tensor([prompt, prompt]), num_tokens=n, block_length=length, steps=steps,
                 do_sample=True, temperature=1.5, seed=3)
    start = len(prompt)
    for row in out.commit_step:
        blocks = [row[start + b * length : start + min(n, (b + 1) * length)] for b in range(3)]
        assert blocks[0].max() < blocks[1].min() and blocks[1].max() < blocks[2].min()
        assert [len(set(b.tolist())) for b in blocks] == [steps, steps, steps]  # S steps in each block
    assert out.num_steps == 3 * steps and not (out.sequences == tokenizer.mask_token_id).any()
    # one block holding every hidden position is plain infilling
    whole = infill(mlm, tokenizer, torch.tensor(prompt), num_tokens=n, steps=3, seed=0)
    assert torch.equal(infill(mlm, tokenizer, torch.tensor(prompt), num_tokens=n, steps=3, seed=0,
                              block_length=n).sequences, whole.sequences)
    # block length 1 with one step each is left to right: the masked-prefix protocol
    ltr = infill(mlm, tokenizer, torch.tensor(prompt), num_tokens=n, order="left_to_right", steps=n)
    assert torch.equal(infill(mlm, tokenizer, torch.tensor(prompt), num_tokens=n, block_length=1).sequences,
                       ltr.sequences)


def test_confidence_noise_anneals_maskgit_style(mlm, tokenizer):
    prompt = torch.tensor(_prompt(tokenizer, "The committee met"))
    plain = infill(mlm, tokenizer, prompt, num_tokens=8, steps=4, seed=0)
    assert torch.equal(infill(mlm, tokenizer, prompt, num_tokens=8, steps=4, seed=0, confidence_noise=0.0)
                       .commit_step, plain.commit_step)
    noisy = [infill(mlm, tokenizer, prompt, num_tokens=8, steps=4, seed=s, confidence_noise=20.0).commit_step
             for s in range(6)]
    assert torch.equal(noisy[0], infill(mlm, tokenizer, prompt, num_tokens=8, steps=4, seed=0,
                                        confidence_noise=20.0).commit_step)  # seeded: reproducible
    assert any(not torch.equal(c, plain.commit_step) for c in noisy)  # the noise changes which commit first
    for kwargs, match in (({"block_length": 0}, "block_length"), ({"block_length": 2.5}, "block_length"),
                          ({"confidence_noise": -1.0}, "confidence_noise"),
                          ({"confidence_noise": 1.0, "order": "random"}, "does not read confidence")):
        with pytest.raises(ValueError, match=match):
            infill(mlm, tokenizer, prompt, num_tokens=4, **kwargs)


def test_infill_errors(mlm, dar, tokenizer):
    ids = torch.tensor(_prompt(tokenizer))
    with pytest.raises(ValueError, match=r"positions to fill \[40\] lie outside the sequence"):
        infill(mlm, tokenizer, ids, [1, 40])
    with pytest.raises(ValueError, match="shape of the ids"):
        infill(mlm, tokenizer, ids, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_position_embeddings=48"):
        infill(mlm, tokenizer, ids, [1], num_tokens=45)
    with pytest.raises(ValueError, match="nothing to fill"):
        infill(mlm, tokenizer, "no mask here")
    no_mask = copy.deepcopy(tokenizer)
    no_mask.mask_token = None
    with pytest.raises(ValueError, match="has no mask token"):
        infill(mlm, no_mask, "The [MASK] met")
    with pytest.raises(UntrainedDecodingError, match="group decoding"):
        infill(dar, tokenizer, ids, [2])
    out = infill(dar, tokenizer, ids, [2], allow_untrained=True)
    assert out.sequences.shape == (1, len(ids))


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def test_cli_generate(tmp_path, dar, mlm, tokenizer, capsys):
    for name, model in (("dar", dar), ("mlm", mlm)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    assert main([str(tmp_path / "dar"), "--prompt", "The committee", "--group_size", "2", "--max_new_tokens", "6",
                 "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    prompt = _prompt(tokenizer, "The committee")
    expected = group_generate(dar, prompt, group_size=2, max_new_tokens=6)[0, len(prompt):]
    assert result["outputs"] == [tokenizer.decode(expected, skip_special_tokens=True)]
    assert main([str(tmp_path / "mlm"), "--infill", "The[MASK] met on[MASK]", "--order", "left_to_right",
                 "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "infill" and result["outputs"][0].startswith("The")
    assert main([str(tmp_path / "mlm"), "--num_tokens", "5", "--do_sample", "--top_p", "0.9", "--num_samples", "2",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.count("[") >= 2
    assert main([str(tmp_path / "mlm"), "--num_tokens", "6", "--block_length", "2", "--steps", "2",
                 "--confidence_noise", "1.0", "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["block_length"] == 2 and result["steps"] == 6  # 3 blocks of 2 steps
    from hf_lookaround.cli import main as cli_main

    assert cli_main(["generate", str(tmp_path / "dar"), "--prompt", "The", "--group_size", "4", "--device", "cpu"]) == 2
    assert re.search("hf-lookaround generate: error: .*group_size=4 was not trained.*--allow_untrained",
                     capsys.readouterr().err)
