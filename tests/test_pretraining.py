"""The Trainer pipeline end to end on a slice of real text (BBC news from the test extra), resuming, errors."""

import json
from pathlib import Path

import pytest
import torch

from hf_lookaround.cli.pretrain import parse_args
from hf_lookaround.training.pretraining import run
from hf_lookaround.data.tokenization import train_tokenizer


TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,hidden_dropout_prob=0.1"


TEXT = None  # 50 BBC news articles, set by the `text_file` fixture


@pytest.fixture(scope="module", autouse=True)
def text_file(bbc_text_dir):
    global TEXT
    TEXT = bbc_text_dir / "train.jsonl.gz"
    return TEXT


def args(tokenizer_dir, output_dir, *extra):
    return [
        "--train_files", str(TEXT), "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny",
        "--config_overrides", TINY, "--block_size", "32", "--validation_split_percentage", "20",
        "--output_dir", str(output_dir), "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
        "--learning_rate", "3e-3", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
        "--use_cpu", "true", *extra,
    ]


def losses(output_dir) -> dict[int, float]:
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def test_resumed_run_follows_the_uninterrupted_loss_curve(tokenizer_dir, tmp_path):
    # 20 blocks, 4 per batch: 5 steps per epoch; checkpoints at 3 (epoch 0), 6 (epoch 1), 9.
    # A random plan (vmlm), dropout and a shuffled sampler: all must be restored exactly.
    common = ("--objective", "vmlm", "--do_train", "--max_train_samples", "20", "--max_steps", "9",
              "--save_steps", "3", "--seed", "11")
    straight = tmp_path / "straight"
    run(*parse_args(args(tokenizer_dir, straight, *common)))
    reference = losses(straight)
    assert sorted(reference) == list(range(1, 10))
    assert len({round(v, 4) for v in reference.values()}) > 5  # a real curve, not a constant
    for start in (3, 6):
        resumed = tmp_path / f"resumed{start}"
        # the checkpoint is copied so that the resumed run writes into its own folder
        run(*parse_args(args(tokenizer_dir, resumed, *common, "--resume_from_checkpoint",
                             str(straight / f"checkpoint-{start}"))))
        curve = losses(resumed)
        after = [s for s in reference if s > start]
        assert [curve[s] for s in after] == pytest.approx([reference[s] for s in after], abs=1e-4), start


def test_end_to_end_records_objective_and_evaluates(tokenizer_dir, tmp_path):
    out = tmp_path / "dar"
    metrics = run(*parse_args(args(tokenizer_dir, out, "--objective", "dar", "--group_size", "2", "3",
                                   "--do_train", "--do_eval", "--max_steps", "6", "--max_train_samples", "24",
                                   "--max_eval_samples", "16", "--perplexity_max_documents", "1",
                                   "--report_to", "tensorboard", "--save_strategy", "no")))
    assert metrics["eval_objective_perplexity"] == pytest.approx(torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-4)
    assert 1 < metrics["eval_ar_perplexity"] < 400 and metrics["eval_bits_per_byte"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["objective"] == "dar" and config["plan_params"] == {"t": [2, 3]}
    assert config["default_attention"] == "causal" and config["architectures"] == ["LookAroundForPreTraining"]
    assert config["use_cache"] is True  # not Trainer's use_cache=False: generate() of the output keeps a KV cache
    # every head is mapped, so the output loads as a causal or masked LM with trust_remote_code as well
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_lookaround.LookAroundForCausalLM"
    assert config["auto_map"]["AutoModelForMaskedLM"] == "modeling_lookaround.LookAroundForMaskedLM"
    assert list((out / "runs").rglob("events.out.tfevents*"))  # TensorBoard
    from transformers import AutoModelForPreTraining, AutoTokenizer

    model = AutoModelForPreTraining.from_pretrained(out)
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(out)) == 400
    try:
        from hf_lookaround.hub.cards import write_model_card
    except ImportError:
        return
    assert "dar" in (out / "README.md").read_text()  # the model card


def test_single_stream_masked_trains_the_masked_lm(tokenizer_dir, tmp_path):
    out = tmp_path / "mlm"
    run(*parse_args(args(tokenizer_dir, out, "--objective", "mlm", "--mask_ratio", "0.3", "--masked_form",
                         "single_stream", "--do_train", "--max_steps", "2", "--save_strategy", "no")))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LookAroundForMaskedLM"] and config["default_attention"] == "bidirectional"
    assert config["plan_params"] == {"mask_ratio": 0.3}


def test_single_stream_ar_trains_gpt_and_decodes_with_its_content_stream(tokenizer_dir, tmp_path, capsys, caplog):
    """--ar_form single_stream: GPT's next-token loss on the causal content stream (LookAroundForCausalLM), no plan
    inputs in the batch, the causal perplexity at the end, and `hf-lookaround generate` decoding through it."""
    from hf_lookaround.cli.generate import main as generate
    from hf_lookaround.objectives import make_collator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "gpt"
    metrics = run(*parse_args(args(tokenizer_dir, out, "--objective", "ar", "--ar_form", "single_stream",
                                   "--do_train", "--do_eval", "--max_steps", "6", "--max_train_samples", "24",
                                   "--max_eval_samples", "16", "--perplexity_max_documents", "1",
                                   "--save_strategy", "no")))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LookAroundForCausalLM"] and config["prediction_stream"] == "content"
    assert 1 < metrics["eval_ar_perplexity"] < 400 and "eval_masked_perplexity" not in metrics
    card = (out / "README.md").read_text()  # the model card shows the causal head, not a two-stream plan
    assert 'head="causal-lm"' in card and "group_ids=plan.group_ids" not in card
    assert "trained one-stream" in card and "one-stream causal text model" in card  # issue 43: the form, named

    tokenizer = AutoTokenizer.from_pretrained(out)
    collator = make_collator("ar", tokenizer, form="single_stream")
    batch = collator([{"input_ids": [tokenizer.bos_token_id, 50, 51, 52]}, {"input_ids": [tokenizer.bos_token_id, 60]}])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["labels"].tolist() == [[-100, 50, 51, 52], [-100, 60, -100, -100]]
    # the eval loss is GPT's: the state at i - 1 predicts token i
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        result = model(**batch)
    logits, labels = result.logits[:, :-1], batch["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    assert result.loss.item() == pytest.approx(expected.item(), rel=1e-5)

    assert generate([str(out), "--prompt", "The government", "--max_new_tokens", "6", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["mode"] == "causal (single stream)" and len(printed["outputs"]) == 1
    from transformers import AutoModelForPreTraining

    caplog.clear()
    with caplog.at_level("WARNING"):  # the pretraining head would read the untrained query stream
        AutoModelForPreTraining.from_pretrained(out)
    assert "trained single-stream (GPT's form of ar" in caplog.text and "AutoModelForCausalLM" in caplog.text
    with pytest.raises(ValueError, match="drop --group_size"):  # its query stream was never trained
        generate([str(out), "--prompt", "The government", "--max_new_tokens", "6", "--group_size", "2"])

    with pytest.raises(ValueError, match="applies to --objective ar only"):
        parse_args(args(tokenizer_dir, tmp_path / "o", "--objective", "dar", "--ar_form", "single_stream"))
    with pytest.raises(ValueError, match="--ar_form must be one of"):
        parse_args(args(tokenizer_dir, tmp_path / "o", "--objective", "ar", "--ar_form", "causal"))


def test_clear_errors(tokenizer_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text found"):
        run(*parse_args(["--train_files", str(empty), "--tokenizer_name", str(tokenizer_dir),
                         "--output_dir", str(tmp_path / "o"), "--do_train"]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        run(*parse_args(args(tokenizer_dir, tmp_path / "o", "--do_train") + [
            "--block_size", "4096"]))
    no_mask = tmp_path / "nomask"
    tok = train_tokenizer(["some text here"] * 20, vocab_size=300)
    tok.mask_token = None
    tok.save_pretrained(no_mask)
    with pytest.raises(ValueError, match="no mask token"):
        run(*parse_args(args(no_mask, tmp_path / "o", "--objective", "vmlm", "--masked_form", "single_stream")))
    with pytest.raises(ValueError, match="mask_ratio_range"):
        parse_args(args(tokenizer_dir, tmp_path / "o", "--objective", "vmlm", "--mask_ratio_range", "0.4", "0.2"))


def _corpus_slice(articles, corpus: Path, per_topic: int) -> Path:
    """The first ``per_topic`` articles of each topic of the real corpus, in the demo's folder layout."""
    for label, name, text in articles:
        folder = corpus / label
        folder.mkdir(parents=True, exist_ok=True)
        if len(list(folder.iterdir())) < per_topic:
            (folder / Path(name).name).write_text(text)
    return corpus


def test_demo_runs_on_a_small_labelled_corpus(tmp_path):
    from hf_lookaround.demo import bbc_news_dir, read_bbc_news, split_articles
    from hf_lookaround.cli.demo import main as demo_main

    source = bbc_news_dir()  # installed by the test extra: a missing corpus fails with what to install
    articles = read_bbc_news(source)
    assert len(articles) == 2225 and len({a[0] for a in articles}) == 5
    splits = split_articles(articles)
    assert [len(v) for v in splits.values()] == [1336, 223, 666]  # 60 / 10 / 30 per topic
    assert not {a[1] for a in splits["train"]} & {a[1] for a in splits["test"]}
    assert split_articles(articles) == splits  # deterministic
    corpus = _corpus_slice(articles, tmp_path / "corpus", per_topic=12)  # keeps the end-to-end run short
    out = tmp_path / "demo"
    assert demo_main(["--corpus-dir", str(corpus), "--objectives", "ar", "vmlm-0.15-0.3", "--tokens-per-objective",
                      "2048", "--batch-size", "8", "--block-size", "64", "--vocab-size", "400",
                      "--perplexity-documents", "3", "--output-dir", str(out), "--quiet", "--seeds", "0", "1"]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    names = ["untrained", "ar", "vmlm-0.15-0.3"]
    assert [(r["name"], r["seed"]) for r in rows] == [(n, s) for s in (0, 1) for n in names]
    for r in rows:
        assert 1 < r["perplexity"] < 1000 and 0 <= r["probe_accuracy"] <= 1
    assert rows[1]["tokens"] == 2048 and rows[1]["plan_params"] == {}
    assert (out / "seed-1" / "ar" / "config.json").is_file()  # every seed's checkpoint is kept
    assert rows[1]["probe_accuracy"] != rows[4]["probe_accuracy"] or rows[1]["perplexity"] != rows[4]["perplexity"]
    results = (out / "results.md").read_text()
    assert "| vmlm-0.15-0.3 |" in results and "How to read this table" in results and "mean of 2 seeds" in results
    # the report names what ran: the folders given (not the default BBC corpus), their labels, two objectives
    assert "one backbone, 2 objectives" in results
    assert "Corpus: the 5 labelled folders of --corpus_dir corpus, 60 articles in 5 labels" in results
    for r in rows:  # the paired probe gain over the untrained model of the same seed, with its standard error
        if r["name"] == "untrained":
            continue
        untrained = next(u for u in rows if u["name"] == "untrained" and u["seed"] == r["seed"])
        assert r["probe_gain"] == pytest.approx(r["probe_accuracy"] - untrained["probe_accuracy"])
        assert r["probe_gain_se"] > 0 and r["probe_accuracy_se"] > 0
        assert r["by_prefix_length"] and r["by_prefix_length"][0]["prefix_length_min"] == 0
    for summary in result["summary"][1:]:  # a claim only where every seed's gain exceeds two standard errors
        runs = [r for r in rows if r["name"] == summary["name"]]
        beating = sum(r["probe_gain"] > 2 * r["probe_gain_se"] for r in runs)
        assert summary["seeds_beating_untrained"] == beating
        assert summary["beats_untrained"] == (beating == 2)
        assert summary["probe_gain"] == pytest.approx(sum(r["probe_gain"] for r in runs) / 2)
    from PIL import Image

    for name in ("perplexity_by_prefix.png", "probe_accuracy.png"):
        assert Image.open(out / name).size[0] > 300, name


def test_the_demo_offers_the_diffusion_objectives_and_scores_them_by_their_elbo(tmp_path):
    """mdlm and bd3lm (two-stream, and bd3lm-4-1s: BD3-LM's one-stream x_t ⊕ x_0 form) are demo rows; their held-out
    column is the ELBO perplexity (a bound, with its standard error), the number `perplexity --protocol elbo` gives
    the saved checkpoint; the one-stream row trains that form and is probed in its layout; the default run is
    unchanged."""
    from transformers import AutoModelForMaskedLM, AutoModelForPreTraining, AutoTokenizer

    from hf_lookaround.cli.demo import _parser, main as demo_main
    from hf_lookaround.demo import DEFAULT_OBJECTIVES, ELBO_SAMPLES, bbc_news_dir, read_bbc_news
    from hf_lookaround.evaluation.perplexity import elbo_perplexity

    choices = next(a.choices for a in _parser()._actions if a.dest == "objectives")
    assert {"mdlm", "bd3lm-4", "bd3lm-16", "bd3lm-4-1s"} <= set(choices)
    assert DEFAULT_OBJECTIVES == ("ar", "dar-t2", "mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3")
    corpus = _corpus_slice(read_bbc_news(bbc_news_dir()), tmp_path / "corpus", per_topic=8)
    out = tmp_path / "demo"
    assert demo_main(["--corpus-dir", str(corpus), "--objectives", "mdlm", "bd3lm-4", "bd3lm-4-1s",
                      "--tokens-per-objective",
                      "1024", "--batch-size", "8", "--block-size", "64", "--vocab-size", "400",
                      "--perplexity-documents", "2", "--output-dir", str(out), "--quiet", "--seeds", "0",
                      "--no-baseline"]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["mdlm", "bd3lm-4", "bd3lm-4-1s"]
    for r in rows:
        assert r["perplexity_protocol"] == "elbo" and r["by_prefix_length"] == []
        assert 1 < r["perplexity"] < 1e4 and r["perplexity_standard_error"] > 0 and 0 <= r["probe_accuracy"] <= 1
    checkpoint = out / "seed-0" / "bd3lm-4"
    model = AutoModelForPreTraining.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    from hf_lookaround.demo import split_articles

    test_texts = [a[2] for a in split_articles(read_bbc_news(corpus))["test"]][:2]
    again = elbo_perplexity(model, tokenizer, test_texts, max_length=64, stride=32, batch_size=32,
                            num_samples=ELBO_SAMPLES, seed=0)
    assert rows[1]["perplexity"] == pytest.approx(again.perplexity, rel=1e-6)
    assert "| ELBO (bound) |" in (out / "results.md").read_text()
    # bd3lm-4-1s trained the one-stream form (its preset's masked_form), which the ELBO scores in x_t ⊕ x_0
    one_stream = json.loads((out / "seed-0" / "bd3lm-4-1s" / "config.json").read_text())
    assert (one_stream["default_attention"], one_stream["attention_group_size"], one_stream["prediction_stream"]) == \
        ("block_diffusion", 4, "content")
    assert json.loads((checkpoint / "config.json").read_text())["default_attention"] != "block_diffusion"
    assert rows[2]["plan_params"]["diffusion_block"] == 4
    masked = AutoModelForMaskedLM.from_pretrained(out / "seed-0" / "bd3lm-4-1s").eval()
    again = elbo_perplexity(masked, tokenizer, test_texts, max_length=64, stride=32, batch_size=32,
                            num_samples=ELBO_SAMPLES, seed=0)
    assert rows[2]["perplexity"] == pytest.approx(again.perplexity, rel=1e-6)
    assert "| bd3lm-4-1s | block diffusion (BD3-LM), b = 4, one stream (x_t ⊕ x_0) |" in (out / "results.md").read_text()


@pytest.mark.parametrize("objective", [("vmlm",), ("gvp", "--num_groups", "4")])
def test_dropping_unread_content_rows_keeps_the_loss_curve(tokenizer_dir, tmp_path, objective, monkeypatch):
    import hf_lookaround.training.unread_content as modeling

    widths = []  # (content columns before, after) of every batch the trainer compacted
    original = modeling.drop_unread_content

    def recording(batch, **kwargs):
        out = original(batch, **kwargs)
        widths.append((batch["input_ids"].shape[1], out["input_ids"].shape[1]))
        return out

    monkeypatch.setattr(modeling, "drop_unread_content", recording)
    # no dropout, so that fewer content rows cannot change which units a step drops
    no_dropout = TINY.replace("hidden_dropout_prob=0.1", "hidden_dropout_prob=0.0")
    curves, evals = {}, {}
    for drop in ("false", "true"):
        out = tmp_path / f"drop_{drop}"
        extra = ("--objective", *objective, "--do_train", "--do_eval", "--max_steps", "4", "--max_train_samples",
                 "16", "--max_eval_samples", "8", "--perplexity_max_documents", "1", "--save_strategy", "no",
                 "--seed", "5", "--drop_unread_content", drop)
        argv = args(tokenizer_dir, out, *extra)
        argv[argv.index(TINY)] = no_dropout
        evals[drop] = run(*parse_args(argv))["eval_loss"]
        curves[drop] = losses(out)
        assert bool(widths) == (drop == "true")  # the flag, and only the flag, compacts the batches
    assert all(after < before for before, after in widths)  # rows were really left out
    assert sorted(curves["true"]) == [1, 2, 3, 4]
    assert len({round(v, 4) for v in curves["false"].values()}) > 1  # the model trains: a curve, not a constant
    assert [curves["true"][s] for s in range(1, 5)] == pytest.approx([curves["false"][s] for s in range(1, 5)], abs=2e-4)
    assert evals["true"] == pytest.approx(evals["false"], abs=2e-4)


def test_demo_claims_a_probe_gain_only_where_every_seed_shows_it():
    from hf_lookaround.demo import Row, reading_guide, results_table, summarize

    def run(name, seed, gain, se=0.02):
        return Row(name, name, None if name == "untrained" else "ar", seed=seed, probe_accuracy=0.5 + gain,
                   probe_accuracy_se=0.02, probe_gain=None if name == "untrained" else gain,
                   probe_gain_se=None if name == "untrained" else se, perplexity=100.0)

    rows = [run("untrained", s, 0.0) for s in (0, 1)]
    rows += [run("steady", 0, 0.10), run("steady", 1, 0.09), run("lucky", 0, 0.10), run("lucky", 1, 0.01),
             run("flat", 0, 0.01), run("flat", 1, -0.02)]
    summaries = summarize(rows)
    assert [(s.name, s.seeds_beating_untrained, s.beats_untrained) for s in summaries[1:]] == [
        ("steady", 2, True), ("lucky", 1, False), ("flat", 0, False)]
    guide = reading_guide(summaries, {"seeds": [0, 1], "test_articles": 666, "num_labels": 5})
    assert "in every seed: steady." in guide
    assert "only in some seeds (not a result): lucky (1 of 2 seeds)" in guide
    assert "in no seed (within noise of the untrained model): flat." in guide
    table = results_table(summaries)
    assert "+0.095: +0.100 ± 0.020, +0.090 ± 0.020 **" in table
    assert "| lucky |" in table and "+0.055: +0.100 ± 0.020, +0.010 ± 0.020 |" in table


def test_the_demo_leaves_transformers_logging_as_it_found_it(tmp_path, monkeypatch):
    """The demo quiets transformers while it runs; the level is global, so it must be restored (a later Trainer in
    the same process reads it to decide on progress bars)."""
    import hf_lookaround.demo as demo
    from transformers.utils import logging as hf_logging

    seen = []
    monkeypatch.setattr(demo, "_run", lambda args: seen.append(hf_logging.get_verbosity()) or [])
    hf_logging.set_verbosity_warning()
    assert demo.run(None) == [] and seen == [hf_logging.ERROR]
    assert hf_logging.get_verbosity() == hf_logging.WARNING

    def failing(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(demo, "_run", failing)
    with pytest.raises(RuntimeError):
        demo.run(None)
    assert hf_logging.get_verbosity() == hf_logging.WARNING
