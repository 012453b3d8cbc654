"""Group decoding with a static cache in one graph per step (issue 41, part 3): the two-stream form at t = 1 and
t > 1 and the one-stream (block-causal) form at t = 2 run each step after the prompt's (forward, pick, EOS and the
token budget, write) as one compiled graph with no host read, and give the tokens of the eager path."""

import pytest
import torch
from transformers import CompileConfig

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM
from hf_lookaround.models.lookaround import generation_lookaround

PAD, BOS = 0, 1
PROMPTS = [[BOS, 17, 5, 40, 22, 9], [BOS, 33], [BOS, 8, 61, 12], [BOS, 50, 50, 7, 30]]
NEW = 13  # not a multiple of 2 or 3: the last group is cut by the budget


def _model(one_stream: bool = False, seed: int = 0):
    form = dict(default_attention="block_causal", attention_group_size=2, prediction_stream="content",
                plan_params={"t": 2}) if one_stream else dict(plan_params={"t": [1, 2, 3]})
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=64, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=48, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=2, mask_token_id=3,
        objective="dar", initializer_range=0.2, **form,
    )
    torch.manual_seed(seed)
    return LookAroundForCausalLM(config).eval()


@pytest.fixture(scope="module")
def two_stream():
    return _model()


@pytest.fixture(scope="module")
def one_stream():
    return _model(one_stream=True)


def _left_padded(prompts=PROMPTS):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _eos_midway(model, ids, mask, t):
    """An EOS token that row 0 first emits after a few tokens (greedy, no EOS, decides), so it stops midway."""
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                          pad_token_id=PAD, group_size=t)[0, ids.shape[1]:].tolist()
    return next(tok for i, tok in enumerate(free) if i >= 3 and tok not in free[:i])


def _one_graph(backend="eager"):
    return dict(cache_implementation="static", compile_config=CompileConfig(backend=backend, fullgraph=True))


CASES = [("two-stream", 1), ("two-stream", 2), ("two-stream", 3), ("one-stream", 2)]


@pytest.mark.parametrize("form,t", CASES)
def test_compiled_static_steps_give_the_eager_tokens(form, t, two_stream, one_stream):
    """Left padding, a row that stops at EOS midway, a budget that cuts the last group: the one-graph steps
    (compiled, fullgraph) give the tokens of the DynamicCache loop, and at t = 1 those of transformers' own
    token-by-token greedy loop."""
    model = one_stream if form == "one-stream" else two_stream
    ids, mask = _left_padded()
    eos = _eos_midway(model, ids, mask, t)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                  group_size=t)
    eager = model.generate(ids, **kwargs)
    new = eager[:, ids.shape[1]:]
    assert (new[0] == eos).any() and not (new[0, -1] == eos)  # row 0 stopped midway: pad after its EOS
    if t == 1:
        token_by_token = model.generate(ids, **{k: v for k, v in kwargs.items() if k != "group_size"})
        assert torch.equal(eager, token_by_token)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), eager)  # the step, eager
    assert torch.equal(model.generate(ids, **_one_graph(), **kwargs), eager)


@pytest.mark.parametrize("form,t", CASES)
def test_each_step_kind_is_one_graph_without_host_reads(form, t):
    """The step compiles whole (fullgraph raises on a graph break), holds no read of a device value on the host
    (dynamo captures ``int(x)`` / ``x.item()`` as an ``item`` node instead of breaking), and once: a second run of
    the same shapes compiles nothing (``error_on_recompile``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = []

    def record(graph_module, example_inputs):  # a backend that keeps each graph dynamo captured, then runs it
        graphs.append(graph_module)
        return graph_module.forward

    model = _model(one_stream=form == "one-stream")  # fresh: no compiled step held from another test
    ids, mask = _left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=PAD,
                  group_size=t, **_one_graph(record))
    start = counters["stats"]["unique_graphs"]
    first = model.generate(ids, **kwargs)
    assert counters["stats"]["unique_graphs"] - start == len(graphs) == 1  # the prompt's forward runs eager
    assert _host_reads(graphs[0]) == []
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(ids, **kwargs), first)
    assert len(graphs) == 1


def _host_reads(graph_module):
    return [node for node in graph_module.graph.nodes
            if node.target in ("item", "tolist", torch.ops.aten._local_scalar_dense.default)]


def test_the_host_read_check_can_tell(monkeypatch):
    """A step that reads a device value on the host (here the number of rows still decoding) shows an ``item``
    node in its graph: the check above is not vacuous."""
    torch._dynamo.reset()
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    step = generation_lookaround._OneGraphGroups._step

    def reads_on_host(self):
        self.state.length.add_(0 * int(self.state.unfinished.sum()))
        return step(self)

    monkeypatch.setattr(generation_lookaround._OneGraphGroups, "_step", reads_on_host)
    model = _model()
    ids, mask = _left_padded()
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                   pad_token_id=PAD, group_size=2, **_one_graph(record))
    assert graphs and _host_reads(graphs[0])


def test_host_work_keeps_the_loop_and_its_tokens(two_stream):
    """What reads tokens on the host (here per-token scores) keeps the loop around a compiled forward; sampling too:
    the same tokens as the DynamicCache path."""
    ids, mask = _left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=[], group_size=2)
    eager = two_stream.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs)
    static = two_stream.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 **_one_graph(), **kwargs)
    assert torch.equal(static.sequences, eager.sequences) and len(static.scores) == NEW
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(static.scores, eager.scores))
    sampled = [two_stream.generate(ids, do_sample=True, generator=torch.Generator().manual_seed(0), **extra,
                                   **kwargs) for extra in ({}, _one_graph())]
    assert torch.equal(*sampled)
