"""Input that used to be accepted silently (and then ignored, truncated or turned into nan) is refused with a
clear error (issue 23, item 12)."""

import json
import random
import shutil

import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining, cli
from conftest import WORDS

TINY = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64"


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("refused")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(30)]
    shutil.copytree(tokenizer_dir, root / "tok")  # conftest's session tokenizer, where these tests look for it
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


def pretrain(data, out, *extra):
    return ["pretrain", "--train_files", str(data / "train.jsonl"), "--tokenizer_name", str(data / "tok"),
            "--preset", "tiny", "--config_overrides", TINY, "--block_size", "16", "--do_train", "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
            "--validation_split_percentage", "0", "--output_dir", str(out), *extra]


def error_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-lookaround ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("extra, words", [
    (("--objective", "dar", "--group_size", "16"), ["--group_size 16", "--block_size 16"]),
    (("--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5", "--group_size", "2", "40"), ["--group_size 40"]),
    (("--streaming", "--max_train_samples", "0"), ["--max_train_samples", ">= 1"]),
    (("--max_train_samples", "0"), ["--max_train_samples", ">= 1"]),
    (("--streaming", "--shuffle_buffer_size", "-1"), ["--shuffle_buffer_size", ">= 0"]),
])
def test_pretrain_refuses(data, tmp_path, capsys, extra, words):
    err = error_line(capsys, pretrain(data, tmp_path / "out", *extra))
    for word in words:
        assert word in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_resuming_with_another_block_size_is_refused(data, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(pretrain(data, out, "--save_steps", "1")) == 0
    err = error_line(capsys, pretrain(data, out, "--max_steps", "3", "--resume_from_checkpoint", "last",
                                      "--block_size", "12"))
    assert "--block_size 16" in err and "--block_size 12" in err


def test_train_tokenizer_into_an_existing_file_is_refused(data, tmp_path, capsys):
    target = tmp_path / "tok.json"
    target.write_text("{}")
    err = error_line(capsys, ["train-tokenizer", str(data / "train.jsonl"), "-o", str(target), "--vocab_size", "300"])
    assert str(target) in err and "folder" in err
    assert target.read_text() == "{}"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset("tiny", vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                                          objective="ar", plan_params={})
    return LookAroundForPreTraining(config).eval()


def test_generate_refuses_top_p_above_one(model):
    from hf_lookaround.generation import group_generate

    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        group_generate(model, torch.tensor([[1, 5, 6]]), group_size=1, max_new_tokens=2, do_sample=True, top_p=1.5)


def test_float_group_ids_are_refused(model):
    ids = torch.tensor([[1, 5, 6, 7]])
    with pytest.raises(ValueError, match="group_ids must be an integer"):
        model(input_ids=ids, group_ids=torch.tensor([[0.0, 0.5, 1.0, 1.5]]))


@pytest.mark.parametrize("head", ["LookAroundForMaskedLM", "LookAroundForCausalLM", "LookAroundForSequenceClassification"])
def test_single_stream_heads_refuse_a_plan(model, tmp_path, head):
    import hf_lookaround

    model.save_pretrained(tmp_path)
    single = getattr(hf_lookaround, head).from_pretrained(tmp_path)
    ids = torch.tensor([[1, 5, 6, 7]])
    with pytest.raises(ValueError, match=f"{head} takes no group_ids"):
        single(input_ids=ids, group_ids=torch.tensor([[0, 1, 1, 2]]))


def test_a_batch_without_targets_has_loss_zero_not_nan(model):
    ids = torch.tensor([[1, 5, 6, 7]])
    labels = torch.full_like(ids, -100)
    out = model(input_ids=ids, group_ids=torch.tensor([[0, 1, 2, 3]]), labels=labels,
                target_positions=torch.tensor([[1, 2]]))
    assert out.loss.item() == 0.0 and not torch.isnan(out.loss)
    out.loss.backward()  # a loss that trains nothing, not an error
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
