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


def test_probing_names_the_same_features():
    from hf_lookaround.evaluation import probing
    from hf_lookaround.models.lookaround import features_lookaround

    assert probing.FEATURES == features_lookaround.FEATURES


@pytest.fixture(scope="module")
def dar_checkpoint(tmp_path_factory):
    """A saved two-stream dar (t = 2) checkpoint with its tokenizer."""
    from hf_lookaround.data.tokenization import train_tokenizer

    texts = ["a good film", "the worst plot I have seen in years", "fine", "an utterly wonderful cast"]
    tokenizer = train_tokenizer(texts * 5, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = H.LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        objective="dar", plan_params={"t": 2}, decoding_group_sizes=[2])
    folder = tmp_path_factory.mktemp("dar")
    H.LookAroundForPreTraining(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_extract_features_pools_the_named_state(dar_checkpoint):
    from transformers import AutoModel

    from hf_lookaround.data.tokenization import encode_sentences
    from hf_lookaround.evaluation.probing import extract_features, max_length_for
    from hf_lookaround.models.lookaround.modeling_lookaround import pool

    folder, tokenizer = dar_checkpoint
    model = AutoModel.from_pretrained(folder).eval()
    texts = ["a good film", "the worst plot I have seen in years"]
    enc = encode_sentences(tokenizer, texts, padding=True, return_tensors="pt")
    for features in ("prediction_state", "content_last_layer"):
        got = extract_features(model, tokenizer, texts, "last", features=features)
        states = token_states(model, enc["input_ids"], enc["attention_mask"], features)
        np.testing.assert_allclose(got, pool(states, enc["attention_mask"], "last").detach().numpy(), atol=1e-5)
    layers = extract_features(model, tokenizer, texts, "mean", features="prediction_state", all_layers=True)
    assert layers.shape == (model.config.num_hidden_layers + 1, 2, model.config.hidden_size)
    # the last column's row predicts the token after the input, one position further
    assert max_length_for(model, tokenizer, None, "prediction_state") == 31
    assert max_length_for(model, tokenizer, None, "content_last_layer") == 32


def test_probe_command_reads_the_named_features(dar_checkpoint, tmp_path):
    import json
    from pathlib import Path

    from hf_lookaround.cli.probe import main

    folder, _ = dar_checkpoint
    data = Path(__file__).resolve().parent / "fixtures" / "review_scores"
    common = ["--model_name_or_path", str(folder), "--dataset", str(data), "--max_train_samples", "80",
              "--max_eval_samples", "40"]
    reports = {}
    for features in ("prediction_state", "content_last_layer"):
        out = tmp_path / features
        assert main(common + ["--features", features, "--all_layers", "--output_dir", str(out)]) == 0
        reports[features] = json.loads((out / "probe_results.json").read_text())
    for features, report in reports.items():
        assert report["features"] == features and len(report["layers"]) == 3
        assert [row["layer"] for row in report["layers"]] == [0, 1, 2]
        assert report["layers"][-1]["test_pearson"] == report["test_pearson"]
    assert reports["prediction_state"]["test_pearson"] != reports["content_last_layer"]["test_pearson"]
    with pytest.raises(SystemExit):
        main(common + ["--features", "prediction_state", "--attention_pattern", "causal", "--output_dir",
                       str(tmp_path / "refused")])


def test_classifier_pools_the_prediction_state_and_trains_the_query_stream(tiny_model):
    from hf_lookaround.models.lookaround.modeling_lookaround import pool

    model = tiny_model(H.LookAroundForSequenceClassification, objective="dar", plan_params={"t": 2},
                       decoding_group_sizes=[2], bos_token_id=BOS, pad_token_id=0, num_labels=3,
                       classifier_features="prediction_state")
    assert model.unused_parameter_names() == []
    ids, mask = batch(6)
    out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2]))
    state = token_states(model.model, ids, mask, "prediction_state")
    torch.testing.assert_close(out.logits, model.score(pool(state, mask, "mean")))
    out.loss.backward()
    assert model.model.query_embedding.grad.abs().sum() > 0
    content = tiny_model(H.LookAroundForSequenceClassification, objective="dar", decoding_group_sizes=[2],
                         num_labels=3)
    assert content.unused_parameter_names() == ["model.query_embedding"]
    with pytest.raises(ValueError, match="classifier_features must be one of"):
        tiny_model(H.LookAroundForSequenceClassification, classifier_features="query")


def test_glue_fine_tunes_on_the_named_features(dar_checkpoint, tmp_path):
    import json
    from pathlib import Path

    from hf_lookaround.cli.glue import main

    folder, _ = dar_checkpoint
    data = Path(__file__).resolve().parent / "fixtures" / "reviews"
    argv = ["--model_name_or_path", str(folder), "--train_file", str(data / "train.jsonl"),
            "--validation_file", str(data / "validation.jsonl"), "--max_train_samples", "32",
            "--max_eval_samples", "16", "--per_device_train_batch_size", "16", "--max_steps", "2",
            "--do_train", "--do_eval", "--report_to", "none", "--save_strategy", "no", "--use_cpu",
            "--features", "prediction_state", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="31 positions"):  # the row after the last token needs one position
        main(argv + ["--max_seq_length", "32"])
    assert main(argv + ["--max_seq_length", "31"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["classifier_features"] == "prediction_state"
    assert np.isfinite(json.loads((tmp_path / "out" / "all_results.json").read_text())["train_loss"])


def test_one_stream_bd3lm_states_are_read_in_its_x_t_x_0_layout(tiny_model):
    """BD3-LM's one-stream form reads x_t ⊕ x_0 only (a plain row of ids would be misread as the two halves): its
    prediction state is the x_t row of each token with that token [MASK] (the masked LM's logits in that layout), its
    content_last_layer the clean half; from the outside, state i never reads token i nor a later block."""
    b, mask_id = 4, 3
    model = tiny_model(H.LookAroundForMaskedLM, prediction_stream="content", objective="bd3lm",
                       default_attention="block_diffusion", attention_group_size=b, bos_token_id=BOS, pad_token_id=0,
                       mask_token_id=mask_id)
    ids, mask = batch(6, lengths=(14, 9))
    length, real = ids.shape[1], mask != 0
    state = token_states(model.model, ids, mask, "prediction_state")
    content = token_states(model.model, ids, mask, "content_last_layer")
    assert state.shape == content.shape == (*ids.shape, model.config.hidden_size)
    sets, column = round(1 / MASKED_FEATURE_RATIO), torch.arange(length)
    seen = torch.zeros_like(real)
    for which in range(sets):  # the masked LM on the layout in which this set is [MASK] in x_t
        hidden = (column % sets == which) & (column > 0) & real
        logits = model(input_ids=torch.cat([ids.masked_fill(hidden, mask_id), ids], 1),
                       attention_mask=torch.cat([mask, mask], 1), one_stream_layout=True).logits
        torch.testing.assert_close(model.lm_head(state)[hidden], logits[:, :length][hidden], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(model.lm_head(content)[real], logits[:, length:][real], atol=2e-5, rtol=1e-4)
        seen |= hidden
    assert torch.equal(seen, real & (column > 0))  # every token but BOS predicted once
    for features, single in (("prediction_state", state), ("content_last_layer", content)):
        tables = token_states(model.model, ids, mask, features, all_layers=True)
        assert len(tables) == model.config.num_hidden_layers + 1
        torch.testing.assert_close(tables[-1], single)
    i = 6  # block 1 (positions 5..8): token 6 and the later blocks are unseen by state 6, token 5 is seen
    for k, read in ((i, False), (10, False), (5, True)):
        changed = ids.clone()
        changed[0, k] = 7 if ids[0, k] != 7 else 8
        other = token_states(model.model, changed, mask, "prediction_state")
        assert ((other[0, i] - state[0, i]).abs().max() > 1e-4) == read, k
    with pytest.raises(ValueError, match="content_last_layer"):
        token_states(model.model, ids, mask, "prediction_state", attention_pattern="bidirectional")
    forced = token_states(model.model, ids, mask, "content_last_layer", attention_pattern="bidirectional")
    assert forced.shape == content.shape and (forced - content)[real].abs().max() > 1e-3


@pytest.mark.parametrize("features", ["content_last_layer", "prediction_state"])
def test_a_classifier_on_one_stream_bd3lm_pools_the_states_of_its_layout(tiny_model, features):
    """Fine-tuning reads what the probes read: on BD3-LM's one-stream form the classifier pools the states of its
    x_t ⊕ x_0 layout (before, content_last_layer ran the plain forward, which misread a row of ids as two halves)."""
    from hf_lookaround.models.lookaround.modeling_lookaround import pool

    model = tiny_model(H.LookAroundForSequenceClassification, prediction_stream="content", objective="bd3lm",
                       default_attention="block_diffusion", attention_group_size=4, bos_token_id=BOS, pad_token_id=0,
                       mask_token_id=3, num_labels=3, classifier_features=features, hidden_dropout_prob=0.0)
    ids, mask = batch(6, lengths=(14, 10))
    logits = model(input_ids=ids, attention_mask=mask).logits
    pooled = pool(token_states(model.model, ids, mask, features), mask, model.config.classifier_pooling)
    torch.testing.assert_close(logits, model.score(pooled))
    # the misreading it replaced, for contrast; the backbone now refuses plain ids unless the layout is asked for
    plain = model.model(input_ids=ids, attention_mask=mask, attention_pattern="block_diffusion").last_hidden_state
    assert (model.score(pool(plain, mask, model.config.classifier_pooling)) - logits).abs().max() > 1e-4
    with pytest.raises(ValueError, match="reads the layout x_t ⊕ x_0 only\\s+when asked"):
        model.model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="drop inputs_embeds"):
        model(inputs_embeds=model.model.get_input_embeddings()(ids), attention_mask=mask)
