"""EleutherAI's lm-evaluation-harness on LookAround checkpoints, in process, offline, with local tasks.

What a user runs is `lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True --include_path TASKS`;
here the same `HFLM` runs through `lm_eval.simple_evaluate` on checkpoints saved in `tmp_path`, a rolling
log-likelihood task (wikitext's form) and a multiple-choice task over JSON Lines the test writes.
"""

import math

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer
from conftest import write_lm_eval_tasks

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM, LookAroundForMaskedLM
from hf_lookaround.evaluation.perplexity import ar_perplexity

# text no test trains on (written for this test); each paragraph is longer than the model's positions
DOCUMENTS = [
    "The lighthouse on the northern cape was built of grey stone in the years before the railway reached the "
    "coast. Its keeper kept a log of every ship that passed, the direction of the wind and the height of the tide.",
    "In winter the keeper walked down to the village twice a week to buy bread, lamp oil and news. The baker "
    "always asked whether the gulls had come back, because the gulls returned a few days before the boats.",
    "A storm tore two slates from the roof of the lamp room. The keeper climbed the ladder with a hammer, and by "
    "evening the roof was sound again and the lamp was lit on time.",
]
CHOICES = [
    {"context": "The keeper climbed the ladder with a hammer and a bag of", "choices": [" nails", " bread", " gulls"], "label": 0},
    {"context": "When the fog came in from the sea, the keeper rang the", "choices": [" bell", " teacher", " crab pots"], "label": 0},
    {"context": "The baker always asked whether the gulls had come", "choices": [" back", " home early", " in"], "label": 0},
]
POSITIONS = 48  # max_position_embeddings of the tiny checkpoints: every document needs several windows
KINDS = ["dar", "dar-one-stream", "ar-single-stream"]
TASKS = {
    "lookaround_rolling": dict(
        output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
        metric_list=[{"metric": "bits_per_byte"}, {"metric": "word_perplexity"}],
    ),
    "lookaround_choice": dict(
        output_type="multiple_choice", doc_to_text="{{context}}", doc_to_choice="{{choices}}", doc_to_target="label",
        metric_list=[{"metric": "acc"}],
    ),
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Local task YAMLs (lm-eval reads YAML; JSON is YAML) over JSON Lines files: no Hub."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    rows = {"lookaround_rolling": [{"text": t} for t in DOCUMENTS], "lookaround_choice": CHOICES}
    return write_lm_eval_tasks(out, TASKS, rows)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _config(tokenizer, **kw):
    return LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=POSITIONS, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id, **kw,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, make_args, tokenizer_dir):
    """dar checkpoints trained by `pretrain`, two-stream (its causal view is the AR plan's query stream) and in
    SAT's one-stream form (its causal view reads the t layouts of the input), and a GPT-form single-stream ar
    checkpoint, each saved with its tokenizer and remote code."""
    from hf_lookaround.cli.pretrain import parse_args
    from hf_lookaround.training.pretraining import run

    root = tmp_path_factory.mktemp("lm_eval_checkpoints")
    overrides = ("hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,"
                 f"max_position_embeddings={POSITIONS}")
    run(*parse_args(make_args(root / "dar", "--objective", "dar", "--group_size", "2", "--config_overrides",
                              overrides, "--save_strategy", "no", max_steps=3)))
    run(*parse_args(make_args(root / "dar-one-stream", "--objective", "dar", "--group_size", "2", "--dar_form",
                              "single_stream", "--config_overrides", overrides, "--save_strategy", "no", max_steps=3)))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    single = LookAroundForCausalLM(_config(tokenizer, objective="ar", prediction_stream="content",
                                           default_attention="causal"))
    single.save_pretrained(root / "ar-single-stream")
    tokenizer.save_pretrained(root / "ar-single-stream")
    return {kind: root / kind for kind in KINDS}


@pytest.fixture(scope="module")
def harness(checkpoints, task_dir):
    """`harness(kind, batch_size)`: both tasks in one `simple_evaluate`, run once per checkpoint and batch size."""
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)  # the built-in index takes ~10 s
    runs = {}

    def run(kind, batch_size):
        if (kind, batch_size) not in runs:
            # our tokenizers add `<s>` and the harness puts its own prefix token (`<s>`) before every rolling document:
            # add_bos_token=False keeps it from also scoring `<s>` after `<s>`. A single-stream causal LM takes
            # n_positions inputs; one less here, so that `ar_perplexity`'s windows (inputs and the last target) fit
            # in the positions too
            positions = LookAroundConfig.from_pretrained(checkpoints[kind]).n_positions
            extra = {} if kind == "dar" else {"max_length": positions - 1}
            lm = HFLM(pretrained=str(checkpoints[kind]), trust_remote_code=True, device="cpu", dtype="float32",
                      batch_size=batch_size, add_bos_token=False, **extra)
            out = simple_evaluate(model=lm, tasks=list(TASKS), task_manager=tasks, log_samples=True,
                                  bootstrap_iters=0)
            samples = {t: sorted(out["samples"][t], key=lambda s: s["doc_id"]) for t in TASKS}
            runs[kind, batch_size] = lm, out["results"], samples
        return runs[kind, batch_size]

    return run


def _rolling_loglikelihoods(samples):
    return torch.tensor([s["resps"][0][0] for s in samples["lookaround_rolling"]], dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_rolling_loglikelihood_is_the_packages_ar_perplexity_at_any_batch_size(kind, checkpoints, harness):
    """bits/byte of a wikitext-style task: equal at batch 1 and 8, and the total NLL `ar_perplexity` gives over the
    same tokens (lm-eval's windows of L inputs predict L tokens: `ar_perplexity` windows of L + 1, stride L)."""
    lm, one, samples_one = harness(kind, 1)
    _, eight, samples_eight = harness(kind, 8)
    # the two-stream causal view predicts token i + 1 at position i + 1: lm-eval must feed one token less (the
    # harness reads n_positions); the one-stream form's lays out 2t - 2 start rows and a BOS (t = 2), one less here
    assert lm.max_length == {"dar": POSITIONS - 1, "dar-one-stream": POSITIONS - 4}.get(kind, POSITIONS - 1)
    bits = [r["lookaround_rolling"]["bits_per_byte,none"] for r in (one, eight)]
    assert bits[0] == pytest.approx(bits[1], rel=1e-6, abs=0)
    torch.testing.assert_close(_rolling_loglikelihoods(samples_one), _rolling_loglikelihoods(samples_eight),
                               rtol=0, atol=2e-5)

    if kind == "dar":  # scored as `pretrain` saved it: the two-stream head with the AR plan
        from transformers import AutoModelForPreTraining

        model = AutoModelForPreTraining.from_pretrained(checkpoints[kind]).eval()
    else:
        model = LookAroundForCausalLM.from_pretrained(checkpoints[kind]).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[kind])
    length = lm.max_length
    ours = ar_perplexity(model, tokenizer, DOCUMENTS, max_length=length + 1, stride=length, batch_size=4)
    assert ours.num_tokens > len(DOCUMENTS) * (length + 1)  # every document needs more than one window
    harness_nll = -_rolling_loglikelihoods(samples_one).sum().item()
    assert harness_nll == pytest.approx(ours.mean_nll * ours.num_tokens, rel=3e-3)
    assert bits[0] == pytest.approx(ours.bits_per_byte, rel=3e-3)


def test_a_single_stream_causal_lm_takes_every_position():
    config = LookAroundConfig(max_position_embeddings=POSITIONS, objective="ar", prediction_stream="content")
    assert config.n_positions == POSITIONS
    assert LookAroundConfig(max_position_embeddings=POSITIONS, objective="dar").n_positions == POSITIONS - 1
    # dar's one-stream form lays its input out after up to 2t - 2 start rows and a BOS
    one_stream = dict(objective="dar", prediction_stream="content", default_attention="block_causal")
    for t in (2, 3):
        config = LookAroundConfig(max_position_embeddings=POSITIONS, attention_group_size=t, **one_stream)
        assert config.n_positions == POSITIONS - (2 * t - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_multiple_choice_loglikelihoods_do_not_depend_on_the_batch_size(kind, harness):
    per_choice = []
    for batch_size in (1, 8):
        _, _, samples = harness(kind, batch_size)
        per_choice.append(torch.tensor([[r[0][0] for r in s["resps"]] for s in samples["lookaround_choice"]],
                                       dtype=torch.float64))
    assert per_choice[0].shape == (len(CHOICES), 3) and torch.isfinite(per_choice[0]).all()
    torch.testing.assert_close(per_choice[0], per_choice[1], rtol=0, atol=2e-6)


def test_a_single_stream_masked_checkpoint_is_refused_with_what_to_use(tmp_path, tokenizer_dir):
    """BERT's `[MASK]` form has no causal view: loading it as a causal LM is refused, naming what scores it."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    masked = LookAroundForMaskedLM(_config(tokenizer, objective="mlm", architectures=["LookAroundForMaskedLM"]))
    assert masked.config.prediction_stream == "content"
    masked.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no causal LM view.*--protocol masked"):
        HFLM(pretrained=str(tmp_path), trust_remote_code=True, device="cpu")


def test_a_truncated_checkpoint_is_refused_in_one_line_naming_the_file(tmp_path, tokenizer_dir):
    """Issue 43: lm-eval loads through from_pretrained, which refuses a cut weights file before transformers reads it
    (safetensors' own error names neither the file nor what to do)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    LookAroundForCausalLM(_config(tokenizer, objective="ar")).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"truncated or damaged \(model\.safetensors has \d+ bytes, its header says") as err:
        HFLM(pretrained=str(tmp_path), trust_remote_code=True, device="cpu")
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)
