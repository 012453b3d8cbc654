"""The named features of probing and fine-tuning (issue 42, item 3): ``prediction_state`` is the state the
pretraining loss trains, read in each form's own training layout; ``content_last_layer`` the content stream's last
layer (what probes read before)."""

import numpy as np
import pytest
import torch

import hf_lookaround as H
from hf_lookaround.models.lookaround.features_lookaround import MASKED_FEATURE_RATIO, token_states
from hf_lookaround.models.lookaround.masking_lookaround import infilling_ranks
from hf_lookaround.objectives import dar

BOS = 1


def batch(seed=0, lengths=(12, 9)):
    """BOS-led rows, right-padded."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(5, 60, (len(lengths), width), generator=g)
    ids[:, 0] = BOS
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def pretraining(tiny_model, **overrides):
    return tiny_model(H.LookAroundForPreTraining, bos_token_id=BOS, pad_token_id=0, **overrides)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_look_ahead_prediction_state_is_what_the_pretraining_head_reads(tiny_model, t):
    model = pretraining(tiny_model, objective="dar", plan_params={"t": t}, decoding_group_sizes=[t])
    ids, mask = batch()
    state = token_states(model.model, ids, mask, "prediction_state")
    content = token_states(model.model, ids, mask, "content_last_layer")
    assert state.shape == content.shape and (state - content).abs().max() > 1e-3
    length = ids.shape[1]
    seen = 0
    for s1 in range(1, t + 1):  # each plan of the objective: its targets that open a group
        group_ids = torch.from_numpy(dar.ranks(np.arange(length), s1, t)).expand_as(ids)
        opens = torch.tensor([k >= s1 and (k - s1) % t == 0 for k in range(length)])
        targets = torch.where(opens & (mask != 0), torch.arange(length), -1)
        logits = model(input_ids=ids, attention_mask=mask, group_ids=group_ids, target_positions=targets).logits
        for b, m in (targets >= 0).nonzero().tolist():
            k = int(targets[b, m])
            torch.testing.assert_close(model.lm_head(state[b, k - 1]), logits[b, m], atol=2e-5, rtol=1e-4)
            seen += 1
    assert seen == int(mask[:, 1:].sum())  # every token but BOS, once


def test_ar_prediction_state_is_the_causal_view_of_a_two_stream_checkpoint(tiny_model):
    model = pretraining(tiny_model, objective="ar", decoding_group_sizes=[1])
    ids, mask = batch(1)
    state = token_states(model.model, ids, mask, "prediction_state")
    causal = H.LookAroundForCausalLM(model.config).eval()
    causal.load_state_dict(model.state_dict(), strict=False)
    logits = causal(input_ids=ids, attention_mask=mask).logits
    real = mask != 0
    torch.testing.assert_close(causal.lm_head(state)[real], logits[real], atol=2e-5, rtol=1e-4)


def test_masked_prediction_state_predicts_each_token_without_seeing_it(tiny_model):
    model = pretraining(tiny_model, objective="mlm", decoding_group_sizes=[])
    ids, mask = batch(2)
    state = token_states(model.model, ids, mask, "prediction_state")
    sets = round(1 / MASKED_FEATURE_RATIO)
    column = torch.arange(ids.shape[1])
    for which in range(sets):  # the pretraining head under the masked plan of each hidden set
        hidden = (column % sets == which) & (mask != 0)
        is_condition = torch.zeros_like(hidden)
        is_condition[:, 0] = ~hidden[:, 0]
        logits = model(input_ids=ids, attention_mask=mask, group_ids=infilling_ranks(hidden, is_condition),
                       labels=torch.where(hidden, ids, -100)).logits
        targets = H.models.lookaround.modeling_lookaround.positions_of(hidden)
        for b, m in (targets >= 0).nonzero().tolist():
            torch.testing.assert_close(model.lm_head(state[b, targets[b, m]]), logits[b, m], atol=2e-5, rtol=1e-4)
    # from the outside: changing token i leaves state i alone, and changes the others'
    changed = ids.clone()
    changed[0, 5] = 7 if ids[0, 5] != 7 else 8
    other = token_states(model.model, changed, mask, "prediction_state")
    torch.testing.assert_close(other[0, 5], state[0, 5])
    assert (other[0, 4] - state[0, 4]).abs().max() > 1e-4


@pytest.mark.parametrize("t", [2, 3])
def test_one_stream_dar_prediction_state_is_the_next_token_view(tiny_model, t):
    model = tiny_model(H.LookAroundForCausalLM, default_attention="block_causal", attention_group_size=t,
                       prediction_stream="content", objective="dar", plan_params={"t": t}, bos_token_id=BOS,
                       pad_token_id=0)
    ids, mask = batch(3)
    state = token_states(model.model, ids, mask, "prediction_state")
    content = token_states(model.model, ids, mask, "content_last_layer")
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask != 0
    torch.testing.assert_close(model.lm_head(state)[real], logits[real], atol=2e-5, rtol=1e-4)
    assert (state - content)[real].abs().max() > 1e-3


def test_one_stream_causal_prediction_state_is_its_last_layer(tiny_model):
    model = tiny_model(H.LookAroundForCausalLM, prediction_stream="content", objective="ar", bos_token_id=BOS)
    ids, mask = batch(4)
    torch.testing.assert_close(token_states(model.model, ids, mask, "prediction_state"),
                               token_states(model.model, ids, mask, "content_last_layer"))
    with pytest.raises(ValueError, match="content_last_layer"):
        token_states(model.model, ids, mask, "prediction_state", attention_pattern="bidirectional")
    with pytest.raises(ValueError, match="features must be one of"):
        token_states(model.model, ids, mask, "query")


@pytest.mark.parametrize("objective,sizes", [("dar", [2]), ("mlm", []), (None, None)])
@pytest.mark.parametrize("features", ["prediction_state", "content_last_layer"])
def test_all_layers_gives_one_table_per_layer_and_the_embeddings(tiny_model, objective, sizes, features):
    overrides = {"objective": objective, "decoding_group_sizes": sizes} if objective else {
        "default_attention": "block_causal", "attention_group_size": 2, "prediction_stream": "content",
        "objective": "dar", "plan_params": {"t": 2}}
    model = pretraining(tiny_model, **overrides) if objective else tiny_model(
        H.LookAroundForCausalLM, bos_token_id=BOS, pad_token_id=0, **overrides)
    ids, mask = batch(5)
    tables = token_states(model.model, ids, mask, features, all_layers=True)
    assert len(tables) == model.config.num_hidden_layers + 1
    assert all(table.shape == tables[-1].shape == (*ids.shape, model.config.hidden_size) for table in tables)
    torch.testing.assert_close(tables[-1], token_states(model.model, ids, mask, features))
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(tables, tables[1:]))
