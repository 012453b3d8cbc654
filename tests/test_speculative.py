"""Self-speculative decoding (``draft_group_size=k``): the tokens of t = 1 decoding, greedy exactly and sampled in
distribution, k at a time through the query stream."""

import json
import logging

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, pipeline

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM, LookAroundForPreTraining
from hf_lookaround.cli.generate import main
from hf_lookaround.data.tokenization import train_tokenizer
from hf_lookaround.decoding import GenerateSpeculativeOutput, UntrainedDecodingError, group_generate
from hf_lookaround.models.lookaround import speculation_lookaround
from hf_lookaround.objectives.ar import plan as autoregressive_plan

PAD, BOS, EOS = 0, 1, 2


def _config(vocab=64, objective="dar", plan_params=None, **kw):
    # initializer_range 0.2: a random model at 0.02 is nearly uniform and its drafts would be rejected at random
    return LookAroundConfig.from_preset(
        "tiny", vocab_size=vocab, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=48, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, mask_token_id=3,
        objective=objective, plan_params={"t": [1, 2, 3, 4]} if plan_params is None else plan_params,
        initializer_range=kw.pop("initializer_range", 0.2), **kw,
    )


def _model(cls=LookAroundForPreTraining, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(_config(**kw)).eval()


@pytest.fixture(scope="module")
def dar():
    return _model()


def _causal(pretraining):
    causal = LookAroundForCausalLM(pretraining.config).eval()
    causal.load_state_dict(pretraining.state_dict())
    return causal


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PROMPTS = [[BOS, 17, 5, 40, 22, 9], [BOS, 33], [BOS, 8, 61, 12], [BOS, 50, 50, 7, 30]]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_greedy_gives_the_tokens_of_t1_decoding(dar, k):
    """Several prompts of several lengths in one left-padded batch; rows accept different numbers of drafts."""
    ids, mask = _left_padded(PROMPTS)
    expected = group_generate(dar, ids, mask, group_size=1, max_new_tokens=23, eos_token_id=[])
    out = group_generate(dar, ids, mask, draft_group_size=k, max_new_tokens=23, eos_token_id=[],
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert isinstance(out, GenerateSpeculativeOutput)
    assert 0 < out.acceptance_rate < 1 and out.num_forwards < 23  # some drafts kept, some rejected
    assert len(set(out.num_accepted.tolist())) > 1, "rows kept as many drafts: the holes went untested"
    # each row alone, and transformers' own token-by-token greedy generate() on the causal head
    causal = _causal(dar)
    plain = causal.generate(ids, attention_mask=mask, max_new_tokens=23, do_sample=False, eos_token_id=None,
                            pad_token_id=PAD)
    assert torch.equal(plain, expected)
    spec = causal.generate(ids, attention_mask=mask, draft_group_size=k, max_new_tokens=23, do_sample=False,
                           eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(spec, expected)
    for row, prompt in enumerate(PROMPTS):
        alone = group_generate(dar, prompt, draft_group_size=k, max_new_tokens=23, eos_token_id=[])
        assert alone[0, len(prompt):].tolist() == expected[row, ids.shape[1]:].tolist()


def test_greedy_after_training_accepts_more_and_stays_exact():
    """A model trained a little on a repetitive sequence: its drafts are mostly right, the output still t = 1's."""
    model = _model(seed=3, initializer_range=0.02)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = torch.tensor([[BOS] + [10, 11, 12, 13, 14, 15] * 6])
    from hf_lookaround.objectives.dar import plan as semi_autoregressive_plan

    for step in range(60):
        t = (1, 2, 3)[step % 3]
        plan = autoregressive_plan([text.shape[1]], text.shape[1]) if t == 1 else \
            semi_autoregressive_plan([text.shape[1]], text.shape[1], t=t, generator=torch.Generator().manual_seed(step))
        labels = text.clone()
        labels[:, 0] = -100
        loss = model(input_ids=text, group_ids=plan.group_ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    prompt = [BOS, 10, 11, 12]
    expected = group_generate(model, prompt, group_size=1, max_new_tokens=20, eos_token_id=[])
    out = group_generate(model, prompt, draft_group_size=3, max_new_tokens=20, eos_token_id=[],
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance_rate > 0.8 and out.num_forwards <= 10 and out.num_plain_steps == 0  # it pays


def test_scores_eos_and_budget_match_t1(dar):
    ids, mask = _left_padded(PROMPTS[:3])
    free = group_generate(dar, ids, mask, group_size=1, max_new_tokens=15, eos_token_id=[])[:, ids.shape[1]:]
    # an EOS that row 0 emits midway and row 1 never does
    eos = next(tok for i, tok in enumerate(free[0].tolist()) if i >= 3 and tok not in free[1].tolist()
               and tok not in free[0, :i].tolist())
    common = dict(max_new_tokens=15, eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    expected = group_generate(dar, ids, mask, group_size=1, **common)
    for k in (2, 4):
        out = group_generate(dar, ids, mask, draft_group_size=k, **common)
        assert torch.equal(out.sequences, expected.sequences)
        row0 = out.sequences[0, ids.shape[1]:].tolist()
        assert eos in row0 and all(tok == PAD for tok in row0[row0.index(eos) + 1:])
        assert len(out.scores) == len(expected.scores) == len(out.logits)
        for got, want in zip(out.logits, expected.logits):  # rows still running: the AR pathway's logits
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
        for got, want in zip(out.scores[: row0.index(eos) + 1], expected.scores):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # max_new_tokens not a multiple of k, and a prompt near max_position_embeddings: the last drafts are cut
    long_prompt = [BOS] + list(range(5, 45))
    for new in (1, 5, 7):
        want = group_generate(dar, long_prompt, group_size=1, max_new_tokens=new, eos_token_id=[])
        got = group_generate(dar, long_prompt, draft_group_size=4, max_new_tokens=new, eos_token_id=[])
        assert torch.equal(got, want), new


@torch.no_grad()
def _exact_ar_distribution(model, prompt, processors, depth):
    """Exact probabilities of the first `depth` new tokens of t = 1 sampling: recompute the AR plan for every prefix."""
    def next_probs(seq):
        ids = torch.tensor([seq + [0]])
        plan = autoregressive_plan([len(ids[0])], len(ids[0])).group_ids
        logits = model(input_ids=ids, group_ids=plan, target_positions=torch.tensor([[len(seq)]])).logits[0]
        return torch.softmax(processors(ids[:, :-1], logits), -1)[0]

    table = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, prob in table.items():
            probs = next_probs(prompt + list(prefix))
            for tok in probs.nonzero().flatten().tolist():
                grown[prefix + (tok,)] = prob * float(probs[tok])
        table = grown
    return table


def _chi_square_p(samples, table):
    """p-value of the samples (tuples) under the exact table, cells with small expectations pooled."""
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if not set(counts) <= set(table):
        return 0.0  # a sample the exact distribution gives probability 0
    n = len(samples)
    cells = sorted(table, key=table.get, reverse=True)
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for cell in cells:
        if table[cell] * n >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(table[cell] * n)
        else:
            pool_o, pool_e = pool_o + counts.get(cell, 0), pool_e + table[cell] * n
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    expected = np.array(expected) * n / sum(expected)
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("k", [2, 3])
def test_sampling_is_distributed_as_t1_sampling(k):
    """The speculative acceptance rule keeps t = 1's distribution (temperature and top-k warpers included): a
    chi-square test of the first tokens against the exact AR probabilities. The drafts alone (group decoding at
    t = k) fail the same test, so it can tell."""
    model = _model(vocab=10, seed=4, initializer_range=0.3)
    prompt, depth, n = [BOS, 6, 4], 2, 4000
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.3), TopKLogitsWarper(5)])
    table = _exact_ar_distribution(model, prompt, processors, depth)
    kwargs = dict(max_new_tokens=depth + 1, eos_token_id=[], do_sample=True, temperature=1.3, top_k=5)
    out = group_generate(model, [prompt] * n, draft_group_size=k, generator=torch.Generator().manual_seed(0),
                         return_dict_in_generate=True, **kwargs)
    samples = [tuple(row) for row in out.sequences[:, len(prompt):len(prompt) + depth].tolist()]
    assert _chi_square_p(samples, table) > 1e-3
    assert 0.05 < out.acceptance_rate < 0.95  # both acceptance and the residual draw were exercised
    drafts_alone = group_generate(model, [prompt] * n, group_size=k, generator=torch.Generator().manual_seed(0),
                                  **kwargs)
    samples = [tuple(row) for row in drafts_alone[:, len(prompt):len(prompt) + depth].tolist()]
    assert _chi_square_p(samples, table) < 1e-6


def test_sampling_reproducible_and_through_generate(dar):
    causal = _causal(dar)
    ids, mask = _left_padded(PROMPTS)
    draws = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        draws.append(causal.generate(ids, attention_mask=mask, draft_group_size=3, do_sample=True, top_p=0.9,
                                     max_new_tokens=12, eos_token_id=None, pad_token_id=PAD))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    # num_return_sequences expands the batch before decoding
    out = causal.generate(ids[:1], attention_mask=mask[:1], draft_group_size=2, do_sample=True,
                          num_return_sequences=3, max_new_tokens=6, eos_token_id=None, pad_token_id=PAD)
    assert out.shape == (3, ids.shape[1] + 6)


def test_refused_without_the_pathways_it_reads():
    prompt = PROMPTS[0]
    no_t1 = _model(plan_params={"t": [2]})
    with pytest.raises(UntrainedDecodingError, match=r"AR \(t=1\) pathway.*never trained.*--group_size 1 2"):
        group_generate(no_t1, prompt, draft_group_size=2, max_new_tokens=4)
    with pytest.raises(UntrainedDecodingError, match=r"AR \(t=1\) pathway"):
        _causal(no_t1).generate(torch.tensor([prompt]), draft_group_size=2, max_new_tokens=4)
    only_small = _model(plan_params={"t": [1, 2]})
    with pytest.raises(UntrainedDecodingError, match="group_size=4 was not trained"):
        group_generate(only_small, prompt, draft_group_size=4, max_new_tokens=4)
    assert group_generate(only_small, prompt, draft_group_size=4, max_new_tokens=4, allow_untrained=True).shape[1] \
        == len(prompt) + 4
    masked = _model(objective="mlm", plan_params={"mask_ratio": 0.15})
    with pytest.raises(UntrainedDecodingError, match="infill"):
        group_generate(masked, prompt, draft_group_size=2, max_new_tokens=4)
    mixture = _model(objective="mixture", plan_params={"mixture": {"ar": 0.5, "dar": 0.5},
                                                       "components": {"ar": {}, "dar": {"t": 2}}})
    assert group_generate(mixture, prompt, draft_group_size=2, max_new_tokens=4).shape[1] == len(prompt) + 4
    dar = _model()
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match="draft_group_size must be an int >= 2"):
            group_generate(dar, prompt, draft_group_size=bad, max_new_tokens=4)
    with pytest.raises(ValueError, match="cannot be combined"):
        group_generate(dar, prompt, group_size=2, draft_group_size=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="use_cache=False"):
        group_generate(dar, prompt, draft_group_size=2, max_new_tokens=4, use_cache=False)
    with pytest.raises(ValueError, match="beam"):
        _causal(dar).generate(torch.tensor([prompt]), draft_group_size=2, num_beams=2, max_new_tokens=4)


CORPUS = ["The committee met on Tuesday and agreed that the budget would be revised before spring.",
          "the of and to in a is that for it as was with be by on not he"]


def test_pipeline_and_cli(tmp_path, capsys, caplog):
    tokenizer = train_tokenizer(CORPUS * 5, vocab_size=300, min_frequency=1)
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    config = _config(vocab=len(tokenizer))
    model = LookAroundForPreTraining(config).eval()
    causal = _causal(model)
    pipe = pipeline("text-generation", model=causal, tokenizer=tokenizer)
    text = "<s>The committee met on"
    enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    expected = group_generate(model, enc["input_ids"], group_size=1, max_new_tokens=9, eos_token_id=[])
    with caplog.at_level(logging.INFO, logger=speculation_lookaround.__name__):
        result = pipe(text, draft_group_size=3, max_new_tokens=9, do_sample=False, eos_token_id=None,
                      return_full_text=False, add_special_tokens=False)
    assert result[0]["generated_text"] == tokenizer.decode(expected[0, enc["input_ids"].shape[1]:])
    assert "drafts accepted" in caplog.text  # the pipeline returns text only: the rate is logged
    model.save_pretrained(tmp_path / "dar")
    tokenizer.save_pretrained(tmp_path / "dar")
    args = [str(tmp_path / "dar"), "--prompt", "The committee met on", "--max_new_tokens", "9", "--device", "cpu"]
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--json", "--draft_group_size", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["outputs"] == plain["outputs"] and spec["mode"] == "self_speculative"
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["forwards"] <= 9
    assert main(args + ["--draft_group_size", "2"]) == 0
    assert "of the drafts accepted" in capsys.readouterr().err
    # the fallback's knob: an infinite break-even runs plain steps after the first window, with the same tokens
    assert main(args + ["--json", "--draft_group_size", "2", "--speculation_break_even", "1e9",
                        "--max_new_tokens", "36"]) == 0
    fallback = json.loads(capsys.readouterr().out)
    assert main(args + ["--json", "--max_new_tokens", "36"]) == 0
    assert fallback["outputs"] == json.loads(capsys.readouterr().out)["outputs"] and fallback["plain_steps"] > 0
    with pytest.raises(ValueError, match="give --draft_group_size too"):
        main(args + ["--speculation_break_even", "0.5"])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_ragged_batches_with_eos_match_token_by_token_greedy(dar, cache):
    """Random prompt lengths, rows that stop at EOS at different steps, budgets that run into
    max_position_embeddings: rejected drafts leave holes, the DynamicCache is compacted near the limit, and the
    tokens stay t = 1's."""
    causal = _causal(dar)
    generator = torch.Generator().manual_seed(0)
    for trial in range(2 if cache == "dynamic" else 1):
        lengths = torch.randint(1, 12, (5,), generator=generator).tolist()
        prompts = [[BOS] + torch.randint(4, 64, (n - 1,), generator=generator).tolist() for n in lengths]
        ids, mask = _left_padded(prompts)
        new = 48 - ids.shape[1]  # up to the last position
        free = causal.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=PAD)
        eos = int(free[:, ids.shape[1]:].flatten().mode().values)  # a token most rows emit at some point
        kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
        expected = causal.generate(ids, **kwargs)
        for k in (2, 4) if cache == "dynamic" else (3,):
            got = causal.generate(ids, draft_group_size=k, cache_implementation=cache, **kwargs)
            assert torch.equal(got, expected), (trial, k)


def test_processors_that_read_the_sequence_see_each_rows_own_tokens(dar):
    """A repetition penalty and min_new_tokens read the sequence so far: with drafts, each row's own tokens
    (drafts included) up to the slot, so the output is still transformers' token-by-token greedy output."""
    causal = _causal(dar)
    ids, mask = _left_padded(PROMPTS)
    free = causal.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=None,
                           pad_token_id=PAD)
    eos = int(free[0, ids.shape[1] + 1])  # row 0's second token: min_new_tokens must hold it back
    kwargs = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, repetition_penalty=3.0, min_new_tokens=4,
                  eos_token_id=eos, pad_token_id=PAD)
    expected = causal.generate(ids, **kwargs)
    assert not torch.equal(expected, free)
    for k in (2, 4):
        assert torch.equal(causal.generate(ids, draft_group_size=k, **kwargs), expected), k


# ----------------------------------------------------------------------------------------------
# One compiled graph per step kind, and the fallback to plain (t = 1) steps
# ----------------------------------------------------------------------------------------------
def _eos_batch(causal, new):
    """A left-padded batch and an EOS token that some rows emit midway (t = 1 greedy, no EOS, decides)."""
    ids, mask = _left_padded(PROMPTS)
    free = causal.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=PAD)
    eos = next(tok for i, tok in enumerate(free[0, ids.shape[1]:].tolist()) if i >= 4 and tok not in
               free[0, ids.shape[1]:ids.shape[1] + i].tolist())
    return ids, mask, eos


def _one_graph_config():
    from transformers import CompileConfig

    # fullgraph: any graph break (a branch on a device value) raises
    return CompileConfig(backend="eager", fullgraph=True)


@pytest.fixture
def short_schedule(monkeypatch):
    """Windows of 2 verify steps and 3 plain steps: a 20-token run switches back and forth."""
    monkeypatch.setattr(speculation_lookaround, "SPECULATION_WINDOW", 2)
    monkeypatch.setattr(speculation_lookaround, "SPECULATION_REST", 3)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("break_even", [0.0, 100.0])
def test_greedy_equals_t1_whatever_the_switching(dar, cache, k, break_even, short_schedule):
    """Left padding, a mid-sequence EOS, rows that keep different numbers of drafts; fallback off (0: never a plain
    step) or forced (every window falls back, then speculation is probed again): always t = 1's tokens. The static
    cache runs the compiled steps (one graph each)."""
    causal = _causal(dar)
    ids, mask, eos = _eos_batch(causal, 20)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    expected = causal.generate(ids, **kwargs)
    assert (expected[:, ids.shape[1]:] == eos).any(-1).tolist().count(True) >= 1
    static = dict(cache_implementation="static", compile_config=_one_graph_config()) if cache == "static" else {}
    out = causal.generate(ids, draft_group_size=k, speculation_break_even=break_even, return_dict_in_generate=True,
                          **static, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.num_forwards == 1 + out.num_speculative_steps + out.num_plain_steps
    if break_even == 0:
        assert out.num_plain_steps == 0
    else:  # fell back, probed again, fell back again
        assert out.num_plain_steps >= 4 and out.num_speculative_steps >= 4


@pytest.mark.parametrize("host_sync", [False, True])
def test_static_cache_steps_compile_as_one_graph_each(host_sync, monkeypatch, short_schedule):
    """The verify-and-draft step and the plain step compile whole: no graph break (fullgraph raises on one), no
    read of a device value on the host inside the graph (dynamo captures ``int(t)`` / ``t.item()`` as an ``item``
    node instead of breaking), and once: a second run of the same shapes compiles nothing. ``host_sync`` puts such
    a read in the step, to show that the check can tell."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    torch._dynamo.reset()
    graphs = []

    def record(graph_module, example_inputs):  # a backend that keeps each graph dynamo captured, then runs it
        graphs.append(graph_module)
        return graph_module.forward

    causal = _causal(_model())  # a fresh model: no compiled step held from another test
    if host_sync:
        content = speculation_lookaround._Speculation._content
        monkeypatch.setattr(speculation_lookaround._Speculation, "_content",
                            lambda self, width: content(self, min(width, 1 + int(self.state.num_new.max()))))
    ids, mask = _left_padded(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                  draft_group_size=3, cache_implementation="static",
                  compile_config=CompileConfig(backend=record, fullgraph=True))

    def graphs_after(break_even):
        causal.generate(ids, speculation_break_even=break_even, **kwargs)
        return counters["stats"]["unique_graphs"] - start

    start = counters["stats"]["unique_graphs"]
    assert graphs_after(0.0) == len(graphs) == 1  # verify-and-draft only: the prompt's forward runs eager
    host_reads = [node for node in graphs[0].graph.nodes
                  if node.target in ("item", "tolist", torch.ops.aten._local_scalar_dense.default)]
    assert bool(host_reads) == host_sync
    if host_sync:
        return
    assert graphs_after(0.0) == 1  # the same shapes again: nothing new
    assert graphs_after(100.0) == len(graphs) == 2  # plain steps: their own graph
    assert graphs_after(100.0) == 2


def test_fallback_rule_is_deterministic_and_does_what_it_says():
    schedule = speculation_lookaround._SpeculationSchedule(0.5)
    window, rest = schedule.window, schedule.rest
    for _ in range(window):  # a window of few accepted drafts
        assert schedule.speculate
        schedule.record(True, 0.25)
    assert not schedule.speculate
    for _ in range(rest):
        assert not schedule.speculate
        schedule.record(False, 0.0)
    assert schedule.speculate  # probed again
    schedule.record(False, 0.0)  # a step that verified nothing (the probe's first) does not count
    for _ in range(window):
        schedule.record(True, 0.75)
    assert schedule.speculate  # paid: no plain steps
    # end to end: this model keeps about 0.7 drafts per step at k = 2: below a break-even of 0.95 (plain steps),
    # above the default (none); the same counts every time, and t = 1's tokens either way
    model = _model()
    ids, mask = _left_padded(PROMPTS)
    expected = group_generate(model, ids, mask, group_size=1, max_new_tokens=40, eos_token_id=[])

    def run(break_even):
        out = group_generate(model, ids, mask, draft_group_size=2, max_new_tokens=40, eos_token_id=[],
                             speculation_break_even=break_even, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        return out.num_speculative_steps, out.num_plain_steps

    assert run(0.95)[1] > 0 and run(0.95) == run(0.95)
    assert run(speculation_lookaround.SPECULATION_BREAK_EVEN)[1] == 0
    with pytest.raises(ValueError, match="speculation_break_even must be a number >= 0"):
        group_generate(model, ids, mask, draft_group_size=2, max_new_tokens=4, speculation_break_even=-1)
    with pytest.raises(ValueError, match="speculation_break_even must be a number >= 0"):
        _causal(model).generate(ids, attention_mask=mask, draft_group_size=2, max_new_tokens=4,
                                speculation_break_even=-1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_seeded_sampling_repeats_with_fallback(dar, cache, short_schedule):
    """A seeded sampled run gives the same tokens every time, fallback switching included (the rule reads tokens,
    never the clock; the compiled step draws from uniforms drawn before it)."""
    causal = _causal(dar)
    ids, mask = _left_padded(PROMPTS)
    static = dict(cache_implementation="static", compile_config=_one_graph_config()) if cache == "static" else {}
    draws = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        draws.append(causal.generate(ids, attention_mask=mask, draft_group_size=3, do_sample=True, top_k=20,
                                     max_new_tokens=16, eos_token_id=None, pad_token_id=PAD,
                                     speculation_break_even=0.8, return_dict_in_generate=True, **static))
    assert torch.equal(draws[0].sequences, draws[1].sequences)
    assert not torch.equal(draws[0].sequences, draws[2].sequences)
    assert draws[0].num_plain_steps > 0 and draws[0].num_plain_steps == draws[1].num_plain_steps


def test_dynamic_cache_never_passes_max_position_embeddings_keys(dar, monkeypatch):
    """Holes of rejected drafts make the DynamicCache wider than the tokens it holds; near the limit it is
    compacted before a step would pass max_position_embeddings keys, never after."""
    seen, compactions = [], []

    def spy(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        seen.append(cache.get_seq_length() + kwargs["input_ids"].shape[1])

    compact = speculation_lookaround._compact_cache
    monkeypatch.setattr(speculation_lookaround, "_compact_cache", lambda *a: compactions.append(1) or compact(*a))
    handle = dar.base_model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        prompts = [[BOS, 5], [BOS] + list(range(5, 20)), [BOS, 9, 9, 9]]
        ids, mask = _left_padded(prompts)
        new = dar.config.max_position_embeddings - ids.shape[1]  # up to the last position
        expected = group_generate(dar, ids, mask, group_size=1, max_new_tokens=new, eos_token_id=[])
        seen.clear()
        for k in (2, 4):
            out = group_generate(dar, ids, mask, draft_group_size=k, max_new_tokens=new, eos_token_id=[],
                                 speculation_break_even=0)
            assert torch.equal(out, expected), k
    finally:
        handle.remove()
    assert compactions and max(seen) == dar.config.max_position_embeddings
