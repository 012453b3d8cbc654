"""``span``: UL2's R- and X-denoisers (T5's span corruption) as a masked-family objective, in one module."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.cli import main as cli_main
from hf_lookaround.objectives import make_collator, max_targets
from hf_lookaround.demo import DEMO_OBJECTIVES
from hf_lookaround.objectives import mixture, span
from hf_lookaround.objectives import make_plan
from hf_lookaround.training.pretraining import ObjectiveArguments
from conftest import BOS, EOS, MASK, PAD, ToyTokenizer

VOCAB = 100
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


def t5_counts(n: int, mean: float, rate: float) -> tuple[int, int]:
    """T5's random_spans_noise_mask counts, written out for one row (Python's round is half to even, as tf.round)."""
    noise = min(max(round(n * rate), 1), n - 1)
    spans = min(max(round(noise / mean), 1), noise, n - noise)
    return noise, spans


def runs(flags) -> list[tuple[bool, int]]:
    """Maximal runs of a 1-D bool sequence: [(value, length), ...]."""
    out = []
    for value in np.asarray(flags, dtype=bool).tolist():
        if out and out[-1][0] == value:
            out[-1] = (value, out[-1][1] + 1)
        else:
            out.append((value, 1))
    return out


def docs(lengths, seed=0, inner_eos=False):
    """Rows <s> w ... w </s>; ``inner_eos``: an EOS in the middle too (packed documents)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        body = torch.randint(10, VOCAB, (n - 2,), generator=g).tolist()
        if inner_eos:
            body[len(body) // 2] = EOS
        rows.append({"input_ids": [BOS] + body + [EOS]})
    return rows


# ---------------------------------------------------------------------------------------------
# the plan: T5's rule
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mean,rate", [(3.0, 0.15), (32.0, 0.5), (1.0, 0.3), (2.5, 0.85)])
@pytest.mark.parametrize("prefix", [0, 1])
def test_counts_and_runs_follow_t5s_rule(mean, rate, prefix):
    seq_len = 300
    lengths = torch.arange(prefix, seq_len + 1)  # every row length, 0 and 1 candidates included
    plan = span.plan(lengths, seq_len, mean, rate, num_condition_tokens=prefix,
                     generator=torch.Generator().manual_seed(1))
    base = 1 if prefix else 0
    for b, length in enumerate(lengths.tolist()):
        n, target, g = length - prefix, plan.is_target[b], plan.group_ids[b]
        assert not target[length:].any() and (g[length:] == 0).all() and not target[:prefix].any()
        assert torch.equal(target, g == base + 1)  # the corrupted positions are the top rank, one group
        if n == 0:
            assert not target.any()
            continue
        if n == 1:
            assert target[prefix] and (g[prefix:length] == base + 1).all()  # the lone candidate is corrupted
            continue
        noise, spans = t5_counts(n, mean, rate)
        row = runs(target[prefix:length])
        assert int(target.sum()) == noise, (n, noise)
        # non-noise first, then alternating: exactly `spans` corrupted runs and as many clean ones
        assert [value for value, _ in row] == [False, True] * spans, (n, row)
        assert (g[prefix:length][~target[prefix:length]] == base).all()


def test_span_lengths_are_uniform_compositions_with_the_parameters_mean():
    """The runs of one row shape: lengths follow the marginal of a uniform composition (chi-square, fixed seed);
    over rows of many lengths, the mean corrupted span is the parameter up to rounding."""
    n, mean, rate, rows = 200, 3.0, 0.15, 4000
    noise, spans = t5_counts(n, mean, rate)  # 30 corrupted tokens in 10 spans
    plan = span.plan([n] * rows, n, mean, rate, generator=torch.Generator().manual_seed(0))
    noise_lengths, clean_lengths = Counter(), Counter()
    for b in range(rows):
        for value, length in runs(plan.is_target[b]):
            (noise_lengths if value else clean_lengths)[length] += 1

    def check(seen: Counter, items: int):
        # one run of a uniform composition of `items` into `spans` parts has length l with probability
        # C(items - l - 1, spans - 2) / C(items - 1, spans - 1)
        total = sum(seen.values())
        assert total == rows * spans
        probs = {l: math.comb(items - l - 1, spans - 2) / math.comb(items - 1, spans - 1)
                 for l in range(1, items - spans + 2)}
        assert sum(probs.values()) == pytest.approx(1.0)
        assert set(seen) <= set(probs)
        observed, expected, rest_o, rest_e = [], [], 0, 0.0
        for length, p in probs.items():  # pool cells expected < 5
            if p * total >= 5:
                observed.append(seen[length])
                expected.append(p * total)
            else:
                rest_o, rest_e = rest_o + seen[length], rest_e + p * total
        observed.append(rest_o)
        expected.append(rest_e)
        assert stats.chisquare(observed, expected).pvalue > 1e-3

    check(noise_lengths, noise)
    check(clean_lengths, n - noise)
    # the mean span length over many row lengths: near the parameter
    for mean, rate in ((3.0, 0.15), (32.0, 0.5)):
        lengths = torch.randint(400, 1025, (500,), generator=torch.Generator().manual_seed(2))
        plan = span.plan(lengths, 1024, mean, rate, generator=torch.Generator().manual_seed(3))
        spans = [length for b in range(len(lengths)) for value, length in runs(plan.is_target[b]) if value]
        assert abs(np.mean(spans) - mean) < 0.05 * mean, (mean, np.mean(spans))


def test_the_exact_distribution_is_the_one_the_plan_draws():
    """The theory module's enumeration (span's exact_plans hook) against make_plan's draws, on short rows."""
    from hf_lookaround.cli.theory import parse_objective
    from hf_lookaround.theory.cooccurrence import EXACT_OBJECTIVES, plan_distribution

    assert "span" in EXACT_OBJECTIVES
    assert parse_objective("span:2,0.5") == ("span", {"mean_span_length": 2.0, "corruption_rate": 0.5})
    assert parse_objective("span") == ("span", {"mean_span_length": 3.0, "corruption_rate": 0.15})
    with pytest.raises(ValueError, match="span:MEAN,RATE"):
        parse_objective("span:2,1.5")
    draws = 6000
    for n, c, params in ((9, 1, {"mean_span_length": 2.0, "corruption_rate": 0.5}),
                         (8, 0, {"mean_span_length": 1.0, "corruption_rate": 0.3}), (2, 1, {})):
        exact = Counter()
        for p, g, target in plan_distribution("span", n, num_condition_tokens=c, **params):
            exact[(tuple(g.tolist()), tuple(target.tolist()))] += p
        assert sum(exact.values()) == pytest.approx(1.0)
        plan = make_plan("span", [n] * draws, n, generator=torch.Generator().manual_seed(4), num_condition_tokens=c,
                         **params)
        seen = Counter(zip(map(tuple, plan.group_ids.tolist()), map(tuple, plan.is_target.tolist())))
        assert set(seen) <= set(exact)
        keys = sorted(exact)
        if len(keys) > 1:
            pvalue = stats.chisquare([seen[k] for k in keys], [exact[k] * draws for k in keys]).pvalue
            assert pvalue > 1e-3, (n, params, pvalue)


def test_special_tokens_are_never_corrupted_and_runs_are_contiguous_among_the_rest():
    lengths = [60, 41, 33, 60]
    collator = make_collator("span", ToyTokenizer(), mean_span_length=3.0, corruption_rate=0.3, seed=0)
    features = docs(lengths, inner_eos=True)
    batch = collator(features)
    ids, target = batch["input_ids"], batch["labels"] != -100
    special = torch.isin(ids, torch.tensor([PAD, BOS, EOS]))
    assert not (target & special).any()
    for b, length in enumerate(lengths):
        maskable = ~special[b, :length]
        n = int(maskable.sum())
        noise, spans = t5_counts(n, 3.0, 0.3)
        assert int(target[b].sum()) == noise
        assert [v for v, _ in runs(target[b, :length][maskable])] == [False, True] * spans


def test_the_same_generator_gives_the_same_plan():
    lengths = torch.randint(2, 65, (32,), generator=torch.Generator().manual_seed(0))
    maskable = torch.rand(32, 64, generator=torch.Generator().manual_seed(1)) > 0.1

    def draw(seed):
        return span.plan(lengths, 64, 3.0, 0.3, num_condition_tokens=1, maskable=maskable,
                         generator=torch.Generator().manual_seed(seed))

    first, again, other = draw(7), draw(7), draw(8)
    assert torch.equal(first.group_ids, again.group_ids) and torch.equal(first.is_target, again.is_target)
    assert not torch.equal(first.is_target, other.is_target)
    collator = make_collator("span", ToyTokenizer(), seed=3)
    features = docs([40, 33, 40])
    assert all(torch.equal(x, y) for x, y in zip(collator(features).values(), collator(features).values()))


# ---------------------------------------------------------------------------------------------
# collator forms, static shapes, parameters
# ---------------------------------------------------------------------------------------------
def test_two_stream_collator():
    params = {"mean_span_length": 3.0, "corruption_rate": 0.15}
    width = max_targets("span", 40, **params)
    collator = make_collator("span", ToyTokenizer(), pad_targets_to=width, seed=0, **params)
    features = docs([40, 25, 40, 12])
    batch = collator(features)
    assert set(batch) == {"input_ids", "attention_mask", "group_ids", "labels", "target_positions"}
    original = collator._pad_tokens(features)[0]
    assert torch.equal(batch["input_ids"], original)  # two-stream: inputs unchanged, no sentinel, no [MASK]
    target = batch["labels"] != -100
    assert torch.equal(batch["labels"][target], original[target])
    assert torch.equal(target, batch["group_ids"] == 2)  # BOS rank 0, visible 1, corrupted 2
    assert (batch["group_ids"][:, 0] == 0).all() and batch["target_positions"].shape == (4, width)


def test_single_stream_collator_masks_every_token_of_every_span():
    collator = make_collator("span", ToyTokenizer(), mean_span_length=3.0, corruption_rate=0.3,
                             form="single_stream", seed=0)
    features = docs([50] * 300)
    batch = collator(features)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    original = collator._pad_tokens(features)[0]
    target = batch["labels"] != -100
    assert torch.equal(batch["labels"][target], original[target])
    assert torch.equal(batch["input_ids"][~target], original[~target])
    noise, spans = t5_counts(48, 3.0, 0.3)
    assert (target.sum(1) == noise).all()
    assert all([v for v, _ in runs(target[b, 1:-1])] == [False, True] * spans for b in range(len(features)))
    became_mask = (batch["input_ids"][target] == MASK).double().mean().item()
    kept = (batch["input_ids"][target] == original[target]).double().mean().item()
    assert abs(became_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02  # BERT's 80/10/10 per token
    every = make_collator("span", ToyTokenizer(), mean_span_length=3.0, corruption_rate=0.3, form="single_stream",
                          mask_replace_prob=1.0, random_replace_prob=0.0, seed=0)(features)
    assert (every["input_ids"][target] == MASK).all()


@pytest.mark.parametrize("rate", [0.15, 0.5, 0.05, 0.125, 0.95])
def test_max_targets_bounds_every_row(rate):
    """``round(rate * n)`` <= ``ceil(rate * T)``: the static width holds for every row length, rounding included."""
    for seq_len in (1, 2, 8, 16, 40, 128):
        bound = max_targets("span", seq_len, mean_span_length=3.0, corruption_rate=rate)
        for prefix in (0, 1):
            lengths = torch.arange(prefix, seq_len + 1)
            plan = span.plan(lengths, seq_len, 3.0, rate, num_condition_tokens=prefix,
                             generator=torch.Generator().manual_seed(0))
            assert int(plan.is_target.sum(1).max()) <= bound, (seq_len, prefix)
    assert objectives.max_target_ratio("span", {"mean_span_length": 3.0, "corruption_rate": rate}) == rate
    # the bound is tight: a full block reaches it where rate * T rounds up
    assert max_targets("span", 40, mean_span_length=3.0, corruption_rate=0.15) == 6
    assert int(span.plan([40], 40, 3.0, 0.15).is_target.sum()) == 6


@pytest.mark.parametrize("flags,message", [
    (["--span_corruption_rate", "1.0"], "--span_corruption_rate must lie strictly between 0 and 1"),
    (["--span_corruption_rate", "0"], "--span_corruption_rate must lie strictly between 0 and 1"),
    (["--span_mean_length", "0.5"], "--span_mean_length must be a finite number >= 1"),
    (["--masked_form", "three_stream"], "--masked_form must be one of"),
])
def test_bad_flags_give_one_clear_line(flags, message, capsys, tmp_path):
    code = cli_main(["pretrain", "--objective", "span", *flags, "--output_dir", str(tmp_path), "--do_train",
                     "--train_files", str(tmp_path / "none.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    with pytest.raises(ValueError, match="corruption_rate must lie strictly"):
        span.plan([10], 10, 3.0, 1.5)


def test_flags_presets_and_the_table():
    args = ObjectiveArguments(objective="span", span_mean_length=32, span_corruption_rate=0.5)
    assert args.plan_params() == {"mean_span_length": 32.0, "corruption_rate": 0.5}
    assert args.collator_params() == {"mean_span_length": 32.0, "corruption_rate": 0.5, "form": "two_stream",
                                      "mask_replace_prob": 0.8, "random_replace_prob": 0.1}
    assert ObjectiveArguments(objective="span", masked_form="single_stream").single_stream_head == "masked"
    assert DEMO_OBJECTIVES["span-r"] == ("span", DEMO_OBJECTIVES["span-r"][1],
                                         {"span_mean_length": 3.0, "span_corruption_rate": 0.15})
    assert DEMO_OBJECTIVES["span-x"][2] == {"span_mean_length": 32.0, "span_corruption_rate": 0.5}
    for row in ("span-r", "span-x"):
        objective, _, flags = DEMO_OBJECTIVES[row]
        ObjectiveArguments(objective=objective, **flags)  # the demo's rows are valid flags
    entry = objectives.get("span")
    assert entry.family == objectives.MASKED and entry.decoders == (objectives.INFILLING,)
    assert entry.drops_unread_content and entry.single_stream_head == objectives.MASKED_HEAD
    assert entry.image_defaults is None and "span" not in objectives.names(images=True)
    assert entry.defaults == {"mean_span_length": 3.0, "corruption_rate": 0.15}


# ---------------------------------------------------------------------------------------------
# the model: pretraining, mixtures (the leak audit: test_objective_collators.py)
# ---------------------------------------------------------------------------------------------
def _pretrain(tmp_path, bbc_text_dir, tokenizer_dir, name, objective_flags):
    out = tmp_path / name
    code = cli_main([
        "pretrain", *objective_flags, "--train_files", str(bbc_text_dir / "train.jsonl.gz"),
        "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny", "--config_overrides", TINY, "--block_size", "32",
        "--validation_split_percentage", "0", "--output_dir", str(out), "--per_device_train_batch_size", "4",
        "--max_steps", "2", "--max_train_samples", "8", "--do_train", "--report_to", "none", "--disable_tqdm", "true",
        "--use_cpu", "true", "--save_strategy", "no", "--logging_steps", "1",
    ])
    assert code == 0
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == [1, 2]
    return out, json.loads((out / "config.json").read_text())


def test_pretrain_span_through_the_cli(bbc_text_dir, tokenizer_dir, tmp_path):
    out, config = _pretrain(tmp_path, bbc_text_dir, tokenizer_dir, "span",
                            ["--objective", "span", "--span_mean_length", "4", "--span_corruption_rate", "0.3"])
    assert config["objective"] == "span" and config["plan_params"] == {"mean_span_length": 4.0,
                                                                       "corruption_rate": 0.3}
    assert config["prediction_stream"] == "query" and config["default_attention"] == "bidirectional"
    assert "span corruption" in (out / "README.md").read_text()
    H.LookAroundForPreTraining.from_pretrained(out)


def test_span_joins_a_mixture(bbc_text_dir, tokenizer_dir, tmp_path):
    # with one component, the mixture draws no component and hands the generator on: the span plan itself
    lengths, maskable = torch.tensor([30, 17, 30]), torch.rand(3, 30, generator=torch.Generator().manual_seed(0)) > .2
    params = {"mean_span_length": 3.0, "corruption_rate": 0.3}
    alone = span.plan(lengths, 30, **params, num_condition_tokens=1, maskable=maskable,
                      generator=torch.Generator().manual_seed(2))
    mixed = mixture.plan(lengths, 30, {"span": 1.0}, {"span": params}, num_condition_tokens=1, maskable=maskable,
                         generator=torch.Generator().manual_seed(2))
    assert torch.equal(alone.is_target, mixed.is_target) and torch.equal(alone.group_ids, mixed.group_ids)
    _, config = _pretrain(tmp_path, bbc_text_dir, tokenizer_dir, "mixture",
                          ["--objective", "mixture", "--mixture", "dar=0.5", "span=0.5"])
    assert config["plan_params"] == {"mixture": {"dar": 0.5, "span": 0.5},
                                     "components": {"dar": {"t": 2},
                                                    "span": {"mean_span_length": 3.0, "corruption_rate": 0.15}}}
