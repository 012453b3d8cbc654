"""Two-stream forward with a KV cache and explicit query rows: chunked decoding equals one full forward."""

import pytest
import torch

import hf_lookaround as H
from hf_lookaround.models.lookaround.modeling_lookaround import NO_TARGET_RANK
from hf_lookaround.objectives import make_plan

VOCAB = 61  # tiny_config's vocabulary (tests/conftest.py)
BACKENDS = ["eager", "sdpa"]


@pytest.fixture
def make_backbone(tiny_model):
    return lambda impl, seed=0, **overrides: tiny_model(H.LookAroundModel, impl, seed, **overrides)


def plans_for_one_row(seq_len, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [seq_len]
    return {
        "ar": make_plan("ar", lengths, seq_len, generator=g).group_ids,
        "dar": make_plan("dar", lengths, seq_len, t=[2, 3], generator=g).group_ids,
        "vmlm": make_plan("vmlm", lengths, seq_len, generator=g).group_ids,
        "gvp": make_plan("gvp", lengths, seq_len, num_groups=4, segmentation="random", generator=g).group_ids,
    }


def group_chunks(ranks: torch.Tensor) -> list[torch.Tensor]:
    """Positions of a row in decoding order: the lowest ranks as a prefix, then one group (rank) per chunk."""
    values = ranks.unique(sorted=True).tolist()
    prefix = max(1, len(values) // 3)
    chunks = [torch.isin(ranks, torch.tensor(values[:prefix])).nonzero().flatten()]
    chunks += [(ranks == v).nonzero().flatten() for v in values[prefix:]]
    return chunks


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("plan_name", ["ar", "dar", "vmlm", "gvp"])
@pytest.mark.parametrize("rope", [True, False])
@torch.no_grad()
def test_cached_chunks_equal_one_full_forward(impl, plan_name, rope, make_backbone):
    """Prefix, then a group, then the next group (any order of positions): the content stream of each chunk and
    the query rows (at the current tokens, and explicit rows at the next group's positions, which have no token
    yet) equal one full two-stream forward with the same ranks."""
    overrides = {} if rope else dict(position_embedding_type="absolute")
    model = make_backbone(impl, **overrides)
    seq_len = 14
    ids = torch.randint(4, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(1))
    ranks = plans_for_one_row(seq_len, seed=len(plan_name))[plan_name]
    full = model(input_ids=ids, group_ids=ranks)  # query rows at every position

    chunks = group_chunks(ranks[0])
    assert len(chunks) >= (2 if plan_name == "vmlm" else 3), "a prefix and the groups after it"
    cache, seen = None, torch.empty(0, dtype=torch.long)
    for c, positions in enumerate(chunks):
        seen = torch.cat([seen, positions])
        nxt = chunks[c + 1] if c + 1 < len(chunks) else positions[:0]
        # explicit rows for the next group (no token yet) and one padding slot
        query_positions = torch.cat([nxt, torch.tensor([0])])[None]
        query_ranks = torch.cat([ranks[0, nxt], torch.tensor([NO_TARGET_RANK])])[None]
        before = _copy(cache)  # the cache grows in place
        out = model(input_ids=ids[:, positions], position_ids=positions[None], group_ids=ranks[:, seen],
                    past_key_values=cache, use_cache=True,
                    query_position_ids=query_positions, query_group_ids=query_ranks)
        torch.testing.assert_close(out.last_hidden_state[0], full.last_hidden_state[0, positions], rtol=0, atol=1e-5)
        torch.testing.assert_close(out.query_hidden_state[0, : len(nxt)], full.query_hidden_state[0, nxt],
                                   rtol=0, atol=1e-5)
        # query rows at the current tokens (target_positions index the current chunk)
        again = model(input_ids=ids[:, positions], position_ids=positions[None], group_ids=ranks[:, seen],
                      past_key_values=before, use_cache=True,
                      target_positions=torch.arange(len(positions))[None])
        torch.testing.assert_close(again.query_hidden_state[0], full.query_hidden_state[0, positions],
                                   rtol=0, atol=1e-5)
        cache = out.past_key_values
        assert cache.get_seq_length() == len(seen), "the cache holds content keys only"


def _copy(cache):
    import copy

    return copy.deepcopy(cache) if cache is not None else None


@pytest.mark.parametrize("impl", BACKENDS)
@torch.no_grad()
def test_cached_groups_with_left_padding_in_a_batch(impl, make_backbone):
    """A batch with left padding: padded keys are invalid in the cache as in the full forward."""
    model = make_backbone(impl)
    ranks = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 3, 3, 4]]).repeat(2, 1)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :2] = 0
    ranks[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    full = model(input_ids=ids, attention_mask=mask, position_ids=positions, group_ids=ranks)
    real = mask.bool()
    cache, start = None, 0
    for end in (5, 7, 9, 10):
        nxt = slice(end, min(end + 2, 10))
        out = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                    group_ids=ranks[:, :end], past_key_values=cache, use_cache=True,
                    query_position_ids=positions[:, nxt], query_group_ids=ranks[:, nxt])
        got, want = out.last_hidden_state, full.last_hidden_state[:, start:end]
        keep = real[:, start:end]
        torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-5)
        torch.testing.assert_close(out.query_hidden_state, full.query_hidden_state[:, nxt], rtol=0, atol=1e-5)
        cache, start = out.past_key_values, end


@pytest.mark.parametrize("impl", BACKENDS)
def test_explicit_query_rows_see_exactly_lower_ranks(impl, make_backbone):
    """A query row of rank r has zero gradient w.r.t. every key of rank >= r, cached or current, and a non-zero
    one for some key of lower rank."""
    model = make_backbone(impl)
    seq_len = 12
    ids = torch.randint(4, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(4))
    ranks = plans_for_one_row(seq_len, seed=7)["gvp"]
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    order = ranks[0].argsort(stable=True)
    split = seq_len // 2
    past, current = order[:split], order[split:]
    prefix = model(inputs_embeds=embeds[:, past], position_ids=past[None], group_ids=ranks[:, past], use_cache=True)
    all_ranks = ranks[:, torch.cat([past, current])]
    query_ranks = torch.arange(int(ranks.max()) + 2)[None]  # every rank, and one above all of them
    query_positions = torch.arange(query_ranks.shape[1])[None] % seq_len
    out = model(inputs_embeds=embeds[:, current], position_ids=current[None], group_ids=all_ranks,
                past_key_values=prefix.past_key_values, use_cache=True,
                query_position_ids=query_positions, query_group_ids=query_ranks)
    for m, rank in enumerate(query_ranks[0].tolist()):
        (grad,) = torch.autograd.grad(out.query_hidden_state[0, m].sum(), embeds, retain_graph=True)
        per_token = grad.abs().sum(-1)[0]
        must_not_see = ranks[0] >= rank
        assert torch.all(per_token[must_not_see] == 0), f"query row of rank {rank} sees ranks >= its own"
        if (~must_not_see).any():
            assert per_token[~must_not_see].max() > 0, f"query row of rank {rank} sees nothing it may see"


def test_cache_api_bad_input(make_backbone):
    model = make_backbone("eager")
    ids = torch.randint(4, VOCAB, (1, 6))
    ranks = torch.arange(6)[None]
    prefix = model(input_ids=ids[:, :4], group_ids=ranks[:, :4], use_cache=True)
    with pytest.raises(ValueError, match="group_ids must have the shape"):
        model(input_ids=ids[:, 4:], group_ids=ranks[:, 4:], past_key_values=prefix.past_key_values, use_cache=True)
    with pytest.raises(ValueError, match="together"):
        model(input_ids=ids, group_ids=ranks, query_position_ids=torch.tensor([[6]]))
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=ids, group_ids=ranks, target_positions=torch.tensor([[1]]),
              query_position_ids=torch.tensor([[6]]), query_group_ids=torch.tensor([[6]]))
    with pytest.raises(ValueError, match="query_position_ids must lie in"):
        model(input_ids=ids, group_ids=ranks, query_position_ids=torch.tensor([[64]]),
              query_group_ids=torch.tensor([[6]]))
