"""Perplexity protocols against brute force, one token at a time, on tiny random models."""

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM, LookAroundForMaskedLM, LookAroundForPreTraining
from hf_lookaround.evaluation.perplexity import (
    ar_perplexity,
    bucket_by_prefix_length,
    encode_documents,
    masked_perplexity,
    sliding_windows,
)
from hf_lookaround.cli.perplexity import main
from hf_lookaround.data.tokenization import train_tokenizer

TEXTS = [
    "The committee met on Tuesday and agreed that the budget would be revised before spring.",
    "A café served crêpes — the owner, Zoë, said prices would rise.",
    "Short one.",
]


@pytest.fixture(scope="module")
def tokenizer():
    corpus = TEXTS * 3 + ["the of and to in a is that for it as was with be by on not he"] * 5
    return train_tokenizer(corpus, vocab_size=300, min_frequency=1)


def _config(tokenizer, **kw):
    torch.manual_seed(0)
    return LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id, **kw,
    )


def _windows(tokenizer, max_length, stride):
    docs, _, has_bos = encode_documents(tokenizer, TEXTS)
    return [w for d in docs for w in sliding_windows(d, max_length, stride, has_bos)]


def _brute_force(tokenizer, max_length, stride, score_one):
    """NLL of every scored token, one model call per token (no batching, no padding)."""
    nlls = []
    for w in _windows(tokenizer, max_length, stride):
        for k in range(w.first_scored, len(w.input_ids)):
            logits = score_one(w.input_ids, k)
            nlls.append(-torch.log_softmax(logits.double(), -1)[w.input_ids[k]].item())
    return np.array(nlls)


def test_sliding_windows_score_every_token_once_with_context():
    ids = list(range(23))
    windows = sliding_windows(ids, max_length=8, stride=3)
    scored = [w.input_ids[k] for w in windows for k in range(w.first_scored, len(w.input_ids))]
    assert scored == ids[1:]  # every token but the first, once, in order
    for w in windows:
        assert len(w.input_ids) <= 8
        if w is not windows[0]:
            assert w.first_scored >= 8 - 3  # at least max_length - stride tokens of context
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(ids, max_length=8, stride=8)


def test_bytes_count_the_scored_utf8_text(tokenizer):
    _, num_bytes, has_bos = encode_documents(tokenizer, TEXTS)
    assert has_bos and num_bytes == sum(len(t.encode("utf-8")) for t in TEXTS)
    docs, no_bos_bytes, has_bos = encode_documents(tokenizer, TEXTS, add_bos=False)
    first = [tokenizer.decode(d[:1]) for d in docs]
    assert not has_bos and no_bos_bytes == sum(len(t.encode()) - len(f.encode()) for t, f in zip(TEXTS, first))


def test_ar_matches_brute_force(tokenizer):
    model = LookAroundForCausalLM(_config(tokenizer)).eval()
    result = ar_perplexity(model, tokenizer, TEXTS, max_length=12, stride=5, batch_size=3)
    expected = _brute_force(
        tokenizer, 12, 5, lambda ids, k: model(input_ids=torch.tensor([ids[:k]])).logits[0, -1]
    )
    np.testing.assert_allclose(result.nlls, expected, rtol=1e-4, atol=1e-5)
    total_tokens = sum(len(tokenizer(t, add_special_tokens=False).input_ids) for t in TEXTS)
    assert result.num_tokens == total_tokens  # BOS makes every text token scored
    assert math.isclose(result.perplexity, math.exp(expected.mean()), rel_tol=1e-5)
    assert math.isclose(result.bits_per_byte, expected.sum() / math.log(2) / result.num_bytes, rel_tol=1e-5)


def test_ar_uniform_model_has_perplexity_of_vocab_size(tokenizer):
    model = LookAroundForCausalLM(_config(tokenizer)).eval()
    torch.nn.init.zeros_(model.lm_head.weight)  # logits all zero: p = 1 / V everywhere
    result = ar_perplexity(model, tokenizer, TEXTS, max_length=16, stride=8)
    assert result.perplexity == pytest.approx(len(tokenizer), rel=1e-5)


def test_ar_works_with_any_causal_lm(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    result = ar_perplexity(model, tokenizer, TEXTS, max_length=10, stride=4, batch_size=4)
    expected = _brute_force(tokenizer, 10, 4, lambda ids, k: model(input_ids=torch.tensor([ids[:k]])).logits[0, -1])
    np.testing.assert_allclose(result.nlls, expected, rtol=1e-4, atol=1e-5)


def test_masked_mask_token_matches_brute_force(tokenizer):
    model = LookAroundForMaskedLM(_config(tokenizer)).eval()
    mask = tokenizer.mask_token_id
    result = masked_perplexity(model, tokenizer, TEXTS, max_length=12, stride=5, batch_size=4, mode="mask_token")

    def one(ids, k):  # x_<k, then [MASK] at k, nothing after
        return model(input_ids=torch.tensor([ids[:k] + [mask]])).logits[0, k]

    np.testing.assert_allclose(result.nlls, _brute_force(tokenizer, 12, 5, one), rtol=1e-4, atol=1e-5)
    # prefix lengths count the text tokens visible before the target, from 0
    assert result.prefix_lengths.min() == 0 and result.prefix_lengths.max() == 11


def test_masked_two_stream_ar_plan_matches_brute_force(tokenizer):
    model = LookAroundForPreTraining(_config(tokenizer)).eval()
    result = masked_perplexity(model, tokenizer, TEXTS, max_length=12, stride=5, batch_size=3, mode="two_stream")

    def one(ids, k):  # truncated after k: nothing after k may change the prediction
        x = torch.tensor([ids[: k + 1]])
        return model(input_ids=x, group_ids=torch.arange(k + 1)[None], target_positions=torch.tensor([[k]])).logits[0, 0]

    np.testing.assert_allclose(result.nlls, _brute_force(tokenizer, 12, 5, one), rtol=1e-4, atol=1e-5)


def test_two_stream_ar_is_the_ar_plan_and_auto_modes(tokenizer):
    model = LookAroundForPreTraining(_config(tokenizer, objective="ar")).eval()
    ar = ar_perplexity(model, tokenizer, TEXTS, max_length=12, stride=5)
    masked = masked_perplexity(model, tokenizer, TEXTS, max_length=12, stride=5)  # auto: AR plan for an ar checkpoint
    assert ar.extra["ar_mode"] == masked.extra["masked_mode"] == "two_stream"
    np.testing.assert_allclose(ar.nlls, masked.nlls, rtol=1e-6)
    mlm = LookAroundForPreTraining(_config(tokenizer, objective="mlm")).eval()
    assert masked_perplexity(mlm, tokenizer, TEXTS[:1], max_length=12, stride=5).extra["masked_mode"] == "two_stream_prefix"
    with pytest.raises(ValueError, match="needs a LookAroundForPreTraining"):
        masked_perplexity(LookAroundForMaskedLM(_config(tokenizer)), tokenizer, TEXTS, mode="two_stream")


def test_masked_two_stream_prefix_matches_brute_force(tokenizer):
    model = LookAroundForPreTraining(_config(tokenizer)).eval()
    result = masked_perplexity(model, tokenizer, TEXTS, max_length=12, stride=5, batch_size=4, mode="two_stream_prefix")

    def one(ids, k):  # as masked pretraining: BOS alone at rank 0, the prefix one bidirectional group, then k
        x = torch.tensor([ids[: k + 1]])
        groups = torch.tensor([[0] + [1] * (k - 1) + [2]] if ids[0] == tokenizer.bos_token_id else [[0] * k + [1]])
        return model(input_ids=x, group_ids=groups, target_positions=torch.tensor([[k]])).logits[0, 0]

    np.testing.assert_allclose(result.nlls, _brute_force(tokenizer, 12, 5, one), rtol=1e-4, atol=1e-5)


def test_bucket_by_prefix_length():
    rows = bucket_by_prefix_length(np.array([1.0, 2.0, 3.0, 5.0]), np.array([0, 1, 3, 2]))
    assert [(r["prefix_length_min"], r["prefix_length_max"], r["num_tokens"]) for r in rows] == [(0, 0, 1), (1, 1, 1), (2, 3, 2)]
    assert rows[2]["perplexity"] == pytest.approx(math.exp(4.0))


def test_command_writes_perplexity_json(tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    LookAroundForPreTraining(_config(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "test.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    for protocol in ("ar", "masked"):
        out = tmp_path / protocol
        args = ["--model_name_or_path", str(model_dir), "--dataset", str(data), "--protocol", protocol,
                "--max_length", "16", "--output_dir", str(out)]
        assert main(args) == 0
        report = json.loads((out / "perplexity.json").read_text())
        key = "ar_perplexity" if protocol == "ar" else "masked_perplexity"
        assert report["protocol"] == protocol and report[key] > 1 and report["bits_per_byte"] > 0
        assert report["num_tokens"] == sum(r["num_tokens"] for r in report["by_prefix_length"])
        assert report["dataset"] == str(data) and (out / "perplexity_by_prefix.png").stat().st_size > 0


def test_real_text_directory(tokenizer, bbc_text_dir):
    from hf_lookaround.evaluation.tasks import load_texts

    texts = load_texts(str(bbc_text_dir), split="validation")
    assert len(texts) == 10 and all(isinstance(t, str) and t for t in texts)
    model = LookAroundForCausalLM(_config(tokenizer)).eval()
    result = ar_perplexity(model, tokenizer, [texts[0][:2000]], max_length=64, stride=32, batch_size=8)
    assert result.num_tokens > 100 and np.isfinite(result.perplexity)


# ---------------------------------------------------------------------------------------------
# a checkpoint of `pretrain` (issue 43): its trained length, and the one-stream mixture's masked half
# ---------------------------------------------------------------------------------------------
ONE_STREAM_MIXTURE = ["--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5", "--group_size", "2",
                      "--dar_form", "single_stream", "--masked_form", "single_stream"]


@pytest.fixture(scope="module")
def one_stream_mixture(make_args, tmp_path_factory):
    from hf_lookaround import cli

    out = tmp_path_factory.mktemp("mixture") / "run"
    assert cli.main(["pretrain", *make_args(out, *ONE_STREAM_MIXTURE, max_steps=1)]) == 0
    return out


def test_the_trained_length_is_recorded_and_is_perplexitys_default_window(one_stream_mixture, bbc_text_dir,
                                                                         tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(one_stream_mixture)
    assert config.trained_block_size == 32 and config.max_position_embeddings > 32  # the capacity stays
    assert AutoTokenizer.from_pretrained(one_stream_mixture).model_max_length == 32  # what transformers reads
    out = tmp_path / "ppl"
    assert main(["--model_name_or_path", str(one_stream_mixture), "--dataset", str(bbc_text_dir / "test.jsonl.gz"),
                 "--max_documents", "1", "--protocol", "ar", "--output_dir", str(out)]) == 0
    assert json.loads((out / "perplexity.json").read_text())["max_length"] == 32


def test_the_one_stream_mixtures_masked_half_is_scored_with_mask_tokens(one_stream_mixture, bbc_text_dir,
                                                                       tmp_path):
    """Its masked half loads as a masked LM (bidirectional over [MASK] inputs): --protocol masked scores it there,
    as it scores a --masked_form single_stream checkpoint, and agrees with masked_perplexity on that masked LM."""
    from hf_lookaround.data.tokenization import auto_tokenizer
    from hf_lookaround.evaluation.tasks import load_texts

    out = tmp_path / "ppl"
    texts = [load_texts(str(bbc_text_dir / "test.jsonl.gz"))[0][:600]]
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": texts[0]}) + "\n")
    assert main(["--model_name_or_path", str(one_stream_mixture), "--dataset", str(data), "--protocol", "masked",
                 "--max_length", "16", "--output_dir", str(out)]) == 0
    report = json.loads((out / "perplexity.json").read_text())
    assert report["masked_mode"] == "mask_token" and np.isfinite(report["masked_perplexity"])
    model = LookAroundForMaskedLM.from_pretrained(one_stream_mixture).eval()
    direct = masked_perplexity(model, auto_tokenizer(one_stream_mixture), texts, max_length=16, stride=8,
                               mode="mask_token")
    assert report["masked_perplexity"] == pytest.approx(direct.perplexity, rel=1e-5)
    # read as a causal LM (its block-causal dar half) it has no bidirectional prefix: still refused, saying what to use
    causal = LookAroundForCausalLM.from_pretrained(one_stream_mixture).eval()
    with pytest.raises(ValueError, match="--protocol ar"):
        masked_perplexity(causal, auto_tokenizer(one_stream_mixture), texts, max_length=16, stride=8)
