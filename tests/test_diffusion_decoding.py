"""Diffusion decoding through generate() (issue 40, part 3): blocks left to right with an exact KV cache over the
clean blocks, parallel unmasking by confidence (threshold or steps), per-row pace, EOS, sampling, refusals, CLI."""

import json

import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM, cli
from hf_lookaround.decoding import DiffusionDecoding, GenerateDiffusionOutput, UntrainedDecodingError
from hf_lookaround.models.lookaround.masking_lookaround import NO_TARGET_RANK
from transformers import CompileConfig
from transformers.generation.streamers import BaseStreamer
from conftest import one_line_error

BLOCK, PAD, BOS, EOS, MASK = 4, 0, 1, 2, 3


def _trained_fields(objective, plan_params) -> dict:
    """The config fields pretraining records from the objective's parameters (what the decoders read)."""
    from hf_lookaround import objectives

    if objective not in ("mdlm", "bd3lm"):  # a checkpoint of another objective records no diffusion block
        return {}
    return objectives.get(objective).Params(**plan_params).config_fields()


def _model(objective="bd3lm", plan_params=None, seed=0):
    torch.manual_seed(seed)
    plan_params = {"diffusion_block": BLOCK} if plan_params is None else plan_params
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=40, hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=48,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, mask_token_id=MASK, objective=objective,
        plan_params=plan_params, prediction_stream="query", initializer_range=0.2,
        **_trained_fields(objective, plan_params))
    return LookAroundForCausalLM(config).eval()


PROMPT = torch.tensor([[BOS, 7, 9, 11, 13, 15]])  # BOS and 5 text tokens: blocks of 4 do not end at the prompt


@torch.no_grad()
def _reference(model, prompt, new, threshold, block=BLOCK):
    """Greedy diffusion decoding of one unpadded row written from the plan alone, recomputing the whole sequence
    every step (no cache): prompt BOS rank 0, text block j rank 1 + 2j; new block k's committed tokens rank
    100 + 2k, its masked positions a query row of rank 100 + 2k + 1; commit every position with probability
    >= threshold, or the most confident one."""
    ids = prompt[0].tolist() + [MASK] * new
    length = len(prompt[0])
    ranks = [0] + [1 + 2 * ((i - 1) // block) for i in range(1, length)]
    ranks += [100 + 2 * (j // block) for j in range(new)]
    committed = [True] * length + [False] * new
    for start in range(length, length + new, block):
        end = min(start + block, length + new)
        while not all(committed[start:end]):
            hidden = [i for i in range(start, end) if not committed[i]]
            out = model.base_model(
                input_ids=torch.tensor([ids[:end]]), attention_mask=torch.tensor([committed[:end]]).long(),
                group_ids=torch.tensor([ranks[:end]]), query_position_ids=torch.tensor([hidden]),
                query_group_ids=torch.tensor([[ranks[i] + 1 for i in hidden]]))
            logits = model.lm_head(out.query_hidden_state)[0].float()
            logits[:, MASK] = float("-inf")
            probs = logits.softmax(-1)
            confidence, tokens = probs.max(-1)
            best = int(confidence.argmax())
            for slot, i in enumerate(hidden):
                if confidence[slot] >= threshold or slot == best:
                    ids[i], committed[i] = int(tokens[slot]), True
    return torch.tensor([ids])


def _decode(model, prompt, new=10, **kwargs):
    kwargs.setdefault("eos_token_id", None)
    return model.generate(prompt, max_new_tokens=new, **kwargs)


@pytest.mark.parametrize("threshold", [0.05, 0.2, 1.5])
def test_the_cached_decoder_gives_the_tokens_of_a_full_recompute(threshold):
    model = _model()
    expected = _reference(model, PROMPT, 10, threshold)
    cached = _decode(model, PROMPT, decoding=DiffusionDecoding(threshold=threshold), return_dict_in_generate=True)
    assert torch.equal(cached.sequences, expected)
    uncached = _decode(model, PROMPT, decoding=DiffusionDecoding(threshold=threshold), use_cache=False)
    assert torch.equal(uncached, expected)
    # the cache holds the clean columns only: the prompt and every block but the last
    assert cached.past_key_values.get_seq_length() == PROMPT.shape[1] + 8


def test_one_commit_per_step_two_ways_and_the_mdlm_block():
    model = _model()
    one_per_step = _decode(model, PROMPT, diffusion_threshold=1.01, return_dict_in_generate=True)
    by_steps = _decode(model, PROMPT, diffusion_steps=BLOCK, return_dict_in_generate=True)
    assert torch.equal(one_per_step.sequences, by_steps.sequences)
    assert one_per_step.num_forwards == by_steps.num_forwards == 10 and by_steps.tokens_per_forward == 1.0
    fewer = _decode(model, PROMPT, diffusion_steps=2, return_dict_in_generate=True)
    # blocks of 4, 4 and 2 tokens, two steps each
    assert fewer.num_forwards == 6 and fewer.tokens_per_forward == pytest.approx(10 / 6)
    # an mdlm checkpoint: one block holding every new token
    mdlm = _model("mdlm", {})
    out = _decode(mdlm, PROMPT, 6, diffusion_threshold=1.5)
    ranks_ref = _reference(mdlm, PROMPT, 6, 1.5, block=6)
    assert torch.equal(out, ranks_ref)


def test_left_padded_rows_equal_their_unbatched_decode_and_keep_their_own_pace():
    model = _model()
    rows = [[BOS, 7, 9, 11, 13, 15], [BOS, 21, 5], [BOS, 30, 31, 8]]
    width = max(len(r) for r in rows)
    batch = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    for knobs in ({"diffusion_threshold": 0.1}, {"diffusion_steps": 2}):
        out = _decode(model, batch, attention_mask=mask, **knobs)
        for b, row in enumerate(rows):
            alone = _decode(model, torch.tensor([row]), **knobs)
            assert torch.equal(out[b, width - len(row):], alone[0]), (knobs, b)


def test_group_generate_runs_the_same_decoder_on_the_pretraining_head():
    """``group_generate(decoding=...)`` (what lm-eval's ``generate_until`` calls on the loaded two-stream head) gives
    ``generate()``'s tokens; ``decoding=`` with a group size is refused in one line."""
    from hf_lookaround import LookAroundForPreTraining
    from hf_lookaround.decoding import group_generate

    model = _model()
    head = LookAroundForPreTraining(model.config).eval()
    head.load_state_dict(model.state_dict())
    batch = torch.tensor([[PAD, PAD, BOS, 21, 5, 9], [BOS, 7, 9, 11, 13, 15]])
    mask = (batch != PAD).long()
    for strategy in (DiffusionDecoding(threshold=0.1), DiffusionDecoding(steps=2)):
        expected = _decode(model, batch, attention_mask=mask, decoding=strategy)
        got = group_generate(head, batch, mask, decoding=strategy, max_new_tokens=10, eos_token_id=[])
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="pass one or the other") as err:
        group_generate(head, batch, mask, decoding=DiffusionDecoding(), group_size=2)
    assert "\n" not in str(err.value)


def test_seeded_sampling_repeats():
    model = _model()

    def sample(seed):
        return _decode(model, PROMPT.expand(3, -1), diffusion_threshold=0.3, do_sample=True, temperature=1.5, top_k=0,
                       top_p=0.95, generator=torch.Generator().manual_seed(seed))

    first = sample(0)
    assert torch.equal(first, sample(0))
    assert not torch.equal(first, sample(1))
    assert not (torch.equal(first[0], first[1]) and torch.equal(first[1], first[2]))  # rows draw their own


def test_eos_stops_a_row():
    model = _model()
    greedy = _decode(model, PROMPT, diffusion_threshold=1.5, return_dict_in_generate=True)
    # the first token committed is the most confident of the first block; make it EOS
    first_block = slice(PROMPT.shape[1], PROMPT.shape[1] + BLOCK)
    eos = int(greedy.sequences[0, first_block][0])
    other = torch.tensor([[BOS, 30, 31, 8, 22, 23]])
    batch = torch.cat([PROMPT, other])
    out = _decode(model, batch, diffusion_threshold=1.5, eos_token_id=eos, pad_token_id=PAD,
                  return_dict_in_generate=True)
    row = out.sequences[0, PROMPT.shape[1]:].tolist()
    end = row.index(eos)
    assert end < BLOCK and all(t == PAD for t in row[end + 1:]) and PAD not in row[:end]
    assert int(out.num_new_tokens[0]) == end + 1
    alone = _decode(model, other, diffusion_threshold=1.5, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(out.sequences[1, : alone.shape[1]], alone[0])  # the other row keeps its pace
    # a batch of the EOS row alone costs one forward per commit up to its EOS, then stops
    single = _decode(model, PROMPT, diffusion_threshold=1.5, eos_token_id=eos, pad_token_id=PAD,
                     return_dict_in_generate=True)
    assert single.num_forwards == end + 1 and single.sequences.shape[1] == PROMPT.shape[1] + end + 1


def test_the_mask_token_is_never_committed():
    model = _model()
    # make the mask token everybody's favourite: without the rule it would fill every position
    model.lm_head.register_forward_hook(lambda module, args, out: out.index_add(
        -1, torch.tensor([MASK]), torch.full((*out.shape[:-1], 1), 100.0)))
    for knobs in ({"diffusion_threshold": 0.5}, {"diffusion_steps": 1}, {"diffusion_threshold": 0.5, "do_sample": True,
                                                                           "top_k": 0}):
        out = _decode(model, PROMPT, **knobs)
        assert out.shape[1] == PROMPT.shape[1] + 10 and not (out[:, PROMPT.shape[1]:] == MASK).any(), knobs


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="not both") as error:
        DiffusionDecoding(threshold=0.9, steps=4)
    assert "\n" not in str(error.value)
    model = _model()
    with pytest.raises(ValueError, match="not both"):
        _decode(model, PROMPT, diffusion_threshold=0.9, diffusion_steps=2)
    for objective, params in (("dar", {"t": 2}), ("mlm", {"mask_ratio": 0.15}), ("ar", {})):
        with pytest.raises(UntrainedDecodingError, match=f"pretrained with the '{objective}' objective") as error:
            _decode(_model(objective, params), PROMPT, diffusion_threshold=0.9)
        assert "\n" not in str(error.value)
    with pytest.raises(UntrainedDecodingError, match="block=2 was not trained"):
        _decode(model, PROMPT, decoding=DiffusionDecoding(block=2))


def test_the_cli_reports_tokens_per_forward(tok, tmp_path, capsys):
    from hf_lookaround import LookAroundForPreTraining

    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, mask_token_id=tok.mask_token_id, objective="bd3lm",
        plan_params={"diffusion_block": 4}, prediction_stream="query", **_trained_fields("bd3lm", {"diffusion_block": 4}))
    LookAroundForPreTraining(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    argv = ["generate", str(tmp_path), "--prompt", "river stone", "--max_new_tokens", "8", "--device", "cpu", "--json"]
    assert cli.main(argv + ["--diffusion_steps", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["mode"] == "diffusion" and printed["diffusion_block"] == 4
    new = printed["new_tokens"][0]
    assert printed["forwards"] <= 4 and printed["tokens_per_forward"] == pytest.approx(new / printed["forwards"])
    assert cli.main(argv) == 0  # no knob: one commit per step
    assert json.loads(capsys.readouterr().out)["mode"] == "diffusion"
    line = one_line_error(capsys, argv + ["--diffusion_steps", "2", "--diffusion_threshold", "0.9"])
    assert "not both" in line


def test_a_static_cache_gives_the_same_tokens_and_each_step_compiles_once():
    """cache_implementation="static": a slot per column, the steps after the prompt's (forward, pick, commit, EOS)
    compile whole (fullgraph) in two shapes (a block's first step, the others), once: a second run of the same
    shapes compiles nothing."""
    torch._dynamo.reset()
    graphs = []

    def record(graph_module, example_inputs):  # a backend that keeps each graph dynamo captured, then runs it
        graphs.append(graph_module)
        return graph_module.forward

    model = _model()
    rows = [[BOS, 7, 9, 11, 13, 15], [BOS, 21, 5]]
    batch = torch.tensor([[PAD] * (6 - len(r)) + r for r in rows])
    kwargs = dict(attention_mask=(batch != PAD).long(), diffusion_threshold=0.2)
    expected = _decode(model, batch, **kwargs)
    assert torch.equal(_decode(model, batch, cache_implementation="static", **kwargs), expected)  # eager on CPU
    _assert_compiles_whole_in_two_graphs_once(model, batch, kwargs, expected, graphs, record)


def _assert_compiles_whole_in_two_graphs_once(model, batch, kwargs, expected, graphs, record):
    """Static-cache decoding through the ``record`` backend (fullgraph) gives ``expected``, in two graphs without a
    host read; a second run of the same shapes compiles nothing."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    static = dict(cache_implementation="static", compile_config=CompileConfig(backend=record, fullgraph=True))
    start = counters["stats"]["unique_graphs"]
    assert torch.equal(_decode(model, batch, **static, **kwargs), expected)
    assert counters["stats"]["unique_graphs"] - start == len(graphs) == 2
    host_reads = [node for graph in graphs for node in graph.graph.nodes
                  if node.target in ("item", "tolist", torch.ops.aten._local_scalar_dense.default)]
    assert not host_reads
    assert torch.equal(_decode(model, batch, **static, **kwargs), expected)
    assert counters["stats"]["unique_graphs"] - start == 2


# ----------------------------------------------------------------------------------------------
# BD3-LM's one-stream form (x_t ⊕ x_0): the static cache gives the dynamic cache's tokens
# ----------------------------------------------------------------------------------------------
def _one_stream_model(impl="eager", seed=0):
    """A bd3lm checkpoint of the one-stream form, its config fields as pretraining records them from the Params."""
    from hf_lookaround.objectives import bd3lm

    torch.manual_seed(seed)
    fields = bd3lm.Params(diffusion_block=BLOCK, masked_form="single_stream").config_fields()
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=40, hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=48,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, mask_token_id=MASK, objective="bd3lm",
        plan_params={"diffusion_block": BLOCK}, prediction_stream="content", initializer_range=0.2, **fields)
    model = LookAroundForCausalLM(config).eval()
    model.set_attn_implementation(impl)
    assert model.config.default_attention == "block_diffusion"
    return model


# left-padded rows of three lengths: prompts that end inside a block and on its edge
ONE_STREAM_ROWS = [[BOS, 7, 9, 11, 13, 15], [BOS, 21, 5], [BOS, 30, 31, 8, 22]]
ONE_STREAM_BATCH = torch.tensor([[PAD] * (6 - len(r)) + r for r in ONE_STREAM_ROWS])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_one_stream_form_gives_the_same_tokens_and_forwards_with_a_static_cache(impl):
    """Greedy (threshold and steps schedules), seeded sampling and EOS on a left-padded batch: the static cache (a slot
    per column, its step eager here: the compiled step is the next test's) gives the dynamic cache's tokens, forwards
    and new-token counts, and the dynamic cache gives those of no cache (every column recomputed each step)."""
    model = _one_stream_model(impl)
    common = dict(attention_mask=(ONE_STREAM_BATCH != PAD).long(), return_dict_in_generate=True)
    greedy = _decode(model, ONE_STREAM_BATCH, diffusion_threshold=1.5, **common)
    eos = int(greedy.sequences[0, 6])  # row 0's first new column: EOS there stops it inside the first block
    runs = [dict(diffusion_threshold=p) for p in (0.05, 0.2, 1.5)] + [dict(diffusion_steps=2)] + [
        dict(diffusion_threshold=0.3, do_sample=True, top_k=0, generator=0),
        dict(diffusion_threshold=1.5, eos_token_id=eos, pad_token_id=PAD)]
    forwards = set()
    for knobs in runs:
        def decode(**cache):
            seeded = dict(knobs, generator=torch.Generator().manual_seed(7)) if "generator" in knobs else knobs
            return _decode(model, ONE_STREAM_BATCH, **common, **seeded, **cache)

        dynamic, static, uncached = decode(), decode(cache_implementation="static"), decode(use_cache=False)
        for other in (static, uncached):
            assert torch.equal(other.sequences, dynamic.sequences), knobs
            assert other.num_forwards == dynamic.num_forwards, knobs
            assert torch.equal(other.num_new_tokens, dynamic.num_new_tokens), knobs
        forwards.add(dynamic.num_forwards)
        if "eos_token_id" in knobs:  # the EOS row stopped early; the others kept their pace
            assert int(dynamic.num_new_tokens[0]) == 1 and (dynamic.sequences[0, 7:] == PAD).all()
            assert int(dynamic.num_new_tokens.max()) > 1
    assert len(forwards) > 1  # the schedules differ: the equal counts are not one constant


def test_the_one_stream_static_steps_compile_whole_in_two_graphs_once():
    """The one-stream form's steps after the prompt's compile whole (fullgraph) with their mask built inside, in two
    shapes (a block's first step, with the finished block's clean rows, and the others), with no host read; a second
    run of the same shapes compiles nothing. The step runs through a recording backend (inductor is slow on CPU)."""
    torch._dynamo.reset()
    graphs = []

    def record(graph_module, example_inputs):  # a backend that keeps each graph dynamo captured, then runs it
        graphs.append(graph_module)
        return graph_module.forward

    model = _one_stream_model("sdpa")
    kwargs = dict(attention_mask=(ONE_STREAM_BATCH != PAD).long(), diffusion_threshold=0.2)
    expected = _decode(model, ONE_STREAM_BATCH, **kwargs)
    _assert_compiles_whole_in_two_graphs_once(model, ONE_STREAM_BATCH, kwargs, expected, graphs, record)


# ----------------------------------------------------------------------------------------------
# The static cache's whole step (forward, pick, commit, EOS) as one compiled graph: the dynamic cache's tokens
# ----------------------------------------------------------------------------------------------
def _recording_backend(graphs, calls=None):
    """A backend that keeps each graph dynamo captured, then runs it (counting its runs in ``calls``)."""
    def record(graph_module, example_inputs):
        graphs.append(graph_module)

        def run(*args):
            if calls is not None:
                calls.append(1)
            return graph_module.forward(*args)

        return run

    return record


def _host_reads(graphs):
    return [node for graph in graphs for node in graph.graph.nodes
            if node.target in ("item", "tolist", torch.ops.aten._local_scalar_dense.default)]


FORMS = {"bd3lm": lambda: _model(), "mdlm": lambda: _model("mdlm", {}), "one-stream": lambda: _one_stream_model("sdpa")}


@pytest.mark.parametrize("form", FORMS)
def test_the_compiled_whole_step_gives_the_dynamic_caches_tokens_forwards_and_counts(form):
    """On a left-padded batch of 3, for the two-stream bd3lm and mdlm checkpoints and BD3-LM's one-stream form:
    greedy with three thresholds, the steps schedule and neither knob, seeded sampling through the warpers, and EOS
    stopping a row midway. The whole step compiled (fullgraph, a recording backend) gives the dynamic cache's tokens,
    forwards and new-token counts; sampling draws the same tokens (multinomial's own noise, drawn before the graph)."""
    torch._dynamo.reset()
    model = FORMS[form]()
    common = dict(attention_mask=(ONE_STREAM_BATCH != PAD).long(), return_dict_in_generate=True)
    greedy = _decode(model, ONE_STREAM_BATCH, diffusion_threshold=1.5, **common)
    eos = int(greedy.sequences[0, 7])  # row 0's second commit: EOS there stops it with a column still masked
    runs = [dict(diffusion_threshold=p) for p in (0.05, 0.2, 1.5)] + [dict(diffusion_steps=2), dict(decoding=DiffusionDecoding())] + [
        dict(diffusion_threshold=0.3, do_sample=True, temperature=1.5, top_k=8, top_p=0.9, generator=0),
        dict(diffusion_steps=3, do_sample=True, generator=0),
        dict(diffusion_threshold=1.5, eos_token_id=eos, pad_token_id=PAD)]
    graphs, calls = [], []
    compiled = dict(cache_implementation="static",
                    compile_config=CompileConfig(backend=_recording_backend(graphs, calls), fullgraph=True))
    for knobs in runs:
        def decode(**cache):
            seeded = dict(knobs, generator=torch.Generator().manual_seed(7)) if "generator" in knobs else knobs
            return _decode(model, ONE_STREAM_BATCH, **common, **seeded, **cache)

        dynamic = decode()
        calls.clear()
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # never a silent eager fallback
            static, one_graph = decode(cache_implementation="static"), decode(**compiled)
        assert len(calls) == dynamic.num_forwards - 1, knobs  # every step after the prompt's ran as a graph
        for other in (static, one_graph):
            assert torch.equal(other.sequences, dynamic.sequences), knobs
            assert other.num_forwards == dynamic.num_forwards, knobs
            assert torch.equal(other.num_new_tokens, dynamic.num_new_tokens), knobs
        if "eos_token_id" in knobs:  # row 0 stopped at its EOS; the others kept their pace
            new = dynamic.sequences[0, 6:].tolist()
            assert eos in new and all(t == PAD for t in new[new.index(eos) + 1:])
            assert int(dynamic.num_new_tokens[0]) == new.index(eos) + 1 < int(dynamic.num_new_tokens.max())
    assert graphs and not _host_reads(graphs)


def test_the_seeded_in_graph_draw_is_multinomials_own():
    """``sampling_noise`` then ``argmax(p / noise)`` draws ``torch.multinomial``'s tokens from the same generator,
    step after step (what lets the compiled step sample the dynamic cache's tokens)."""
    from hf_lookaround.models.lookaround.decoding_lookaround import _pick, sampling_noise

    scores = torch.randn(12, 40) * 3
    eager, in_graph = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(10):
        expected = _pick(scores, True, eager)
        assert torch.equal(_pick(scores, True, noise=sampling_noise(scores.shape, "cpu", in_graph)), expected)
    assert not torch.equal(_pick(scores, True, torch.Generator().manual_seed(6)), expected)


def test_the_mdlm_step_is_one_graph_and_the_host_read_check_can_tell(monkeypatch):
    """An mdlm checkpoint decodes one block: after the prompt's step, one graph (compiled once, no host read). A
    commit that reads a device value on the host shows an ``item`` node: the check is not vacuous."""
    from hf_lookaround.models.lookaround import diffusion_lookaround

    model = _model("mdlm", {})
    kwargs = dict(attention_mask=(ONE_STREAM_BATCH != PAD).long(), diffusion_threshold=0.2)
    expected = _decode(model, ONE_STREAM_BATCH, **kwargs)
    for reads in (False, True):
        torch._dynamo.reset()
        model._lookaround_diffusion_steps = None
        graphs = []
        static = dict(cache_implementation="static",
                      compile_config=CompileConfig(backend=_recording_backend(graphs), fullgraph=True))
        if reads:
            commit = diffusion_lookaround._DiffusionRun._commit

            def reads_on_host(self, logits, noise=None):
                self.state.step.add_(0 * int(self.state.unfinished.sum()))
                return commit(self, logits, noise)

            monkeypatch.setattr(diffusion_lookaround._DiffusionRun, "_commit", reads_on_host)
        assert torch.equal(_decode(model, ONE_STREAM_BATCH, **static, **kwargs), expected)
        assert len(graphs) == 1 and bool(_host_reads(graphs)) == reads
        if not reads:  # again, with a streamer: it is handed the tokens at the end, the graph is kept
            streamed = []

            class Streamer(BaseStreamer):
                def put(self, value):
                    streamed.append(value)

                def end(self):
                    streamed.append(None)

            with torch._dynamo.config.patch(error_on_recompile=True):
                again = _decode(model, ONE_STREAM_BATCH, streamer=Streamer(), **static, **kwargs)
            assert torch.equal(again, expected) and len(graphs) == 1
            # generate() shows the prompt first; the decoder then row 0's new tokens, once
            assert torch.equal(streamed[-2], expected[0, ONE_STREAM_BATCH.shape[1]:]) and streamed[-1] is None
