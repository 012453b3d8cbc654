"""Input checks of the commands and the model: bad data and bad files end a command with one line that names the
file and what to fix, never a traceback (a bare StopIteration, DatasetGenerationError, SafetensorError or
AssertionError); input that used to be accepted silently (then ignored, truncated or turned into nan) is refused
with a clear error."""

import json
import random
import shutil

import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining, cli
from conftest import WORDS, one_line_error

TINY = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64"


def documents(n=30, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n)]


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("bad_input")
    shutil.copytree(tokenizer_dir, root / "tok")  # conftest's session tokenizer, where these tests look for it
    good = write_jsonl(root / "good.jsonl", documents())
    (root / "empty.jsonl").write_text("")
    text = good.read_text()
    (root / "cut.jsonl").write_text(text[: text.index("\n", 1000) + 40])  # a line cut short in the middle
    (root / "latin1.jsonl").write_bytes(json.dumps({"text": "caf\u00e9 " * 40}, ensure_ascii=False).encode("latin-1"))
    return root


def pretrain(data, tmp_path, *files, extra=()):
    return ["pretrain", "--train_files", *[str(data / f) for f in files], "--tokenizer_name", str(data / "tok"),
            "--preset", "tiny", "--config_overrides", TINY, "--block_size", "16", "--do_train", "--max_steps", "1",
            "--per_device_train_batch_size", "2", "--report_to", "none", "--disable_tqdm", "true",
            "--use_cpu", "true", "--validation_split_percentage", "0", "--output_dir", str(tmp_path / "out"), *extra]




@pytest.mark.parametrize("extra", [(), ("--streaming",)], ids=["map", "streaming"])
def test_an_empty_jsonl_file_is_named(data, tmp_path, capsys, extra):
    err = one_line_error(capsys, pretrain(data, tmp_path, "empty.jsonl", extra=extra))
    assert "empty.jsonl" in err and "empty" in err


def test_an_empty_validation_file_is_named(data, tmp_path, capsys):
    argv = pretrain(data, tmp_path, "good.jsonl", extra=("--do_eval", "--validation_files", str(data / "empty.jsonl")))
    err = one_line_error(capsys, argv)
    assert "empty.jsonl" in err and "validation" in err


def test_an_empty_shard_among_good_files_is_skipped_with_a_warning(data, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="hf_lookaround.data.text"):
        assert cli.main(pretrain(data, tmp_path, "good.jsonl", "empty.jsonl")) == 0
    assert any("empty.jsonl" in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)


def test_a_cut_short_jsonl_line_is_named_with_its_line_number(data, tmp_path, capsys):
    err = one_line_error(capsys, pretrain(data, tmp_path, "cut.jsonl"))
    lines = (data / "cut.jsonl").read_text().splitlines()
    assert f"cut.jsonl:{len(lines)}:" in err and "fix or remove" in err


def test_non_utf8_text_is_named(data, tmp_path, capsys):
    err = one_line_error(capsys, pretrain(data, tmp_path, "latin1.jsonl"))
    assert "latin1.jsonl" in err and "UTF-8" in err


# ---------------------------------------------------------------------------------------------
# checkpoints and devices
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory):
    from transformers import AutoTokenizer

    from hf_lookaround import LookAroundConfig, LookAroundForPreTraining

    tok = AutoTokenizer.from_pretrained(data / "tok")
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, mask_token_id=tok.mask_token_id, objective="ar", plan_params={})
    out = tmp_path_factory.mktemp("ckpt") / "model"
    LookAroundForPreTraining(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def truncated(checkpoint, tmp_path):
    import shutil

    out = tmp_path / "truncated"
    shutil.copytree(checkpoint, out)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return out


@pytest.mark.parametrize("command", ["generate", "perplexity", "pretrain"])
def test_a_truncated_model_safetensors_is_named(truncated, data, tmp_path, capsys, command):
    if command == "generate":
        argv = ["generate", str(truncated), "--prompt", "river", "--max_new_tokens", "2", "--device", "cpu"]
    elif command == "perplexity":
        argv = ["perplexity", "--model_name_or_path", str(truncated), "--dataset", str(data / "good.jsonl"),
                "--output_dir", str(tmp_path / "ppl"), "--device", "cpu", "--max_documents", "1"]
    else:
        argv = pretrain(data, tmp_path, "good.jsonl", extra=("--model_name_or_path", str(truncated)))
    err = one_line_error(capsys, argv)
    assert "model.safetensors" in err and str(truncated) in err and "truncated" in err


def test_generate_on_a_missing_cuda_device_is_one_line(checkpoint, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on the CPU build, on any machine
    err = one_line_error(capsys, ["generate", str(checkpoint), "--prompt", "river", "--device", "cuda"])
    assert "--device cuda" in err and "--device cpu" in err


def test_a_full_disk_during_a_save_names_the_folder(data, tmp_path, capsys, monkeypatch):
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError

    def full(*args, **kwargs):  # what safetensors raises when the disk fills up
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    err = one_line_error(capsys, pretrain(data, tmp_path, "good.jsonl", extra=("--save_steps", "1")))
    assert "disk is full" in err and str(tmp_path / "out") in err


# ---------------------------------------------------------------------------------------------
# input accepted silently before: now refused
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def refused_data(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("refused")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(30)]
    shutil.copytree(tokenizer_dir, root / "tok")  # conftest's session tokenizer, where these tests look for it
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


def pretrain_argv(refused_data, out, *extra):
    return ["pretrain", "--train_files", str(refused_data / "train.jsonl"), "--tokenizer_name", str(refused_data / "tok"),
            "--preset", "tiny", "--config_overrides", TINY, "--block_size", "16", "--do_train", "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
            "--validation_split_percentage", "0", "--output_dir", str(out), *extra]


@pytest.mark.parametrize("extra, words", [
    (("--objective", "dar", "--group_size", "16"), ["--group_size 16", "--block_size 16"]),
    (("--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5", "--group_size", "2", "40"), ["--group_size 40"]),
    (("--streaming", "--max_train_samples", "0"), ["--max_train_samples", ">= 1"]),
    (("--max_train_samples", "0"), ["--max_train_samples", ">= 1"]),
    (("--streaming", "--shuffle_buffer_size", "-1"), ["--shuffle_buffer_size", ">= 0"]),
])
def test_pretrain_refuses(refused_data, tmp_path, capsys, extra, words):
    err = one_line_error(capsys, pretrain_argv(refused_data, tmp_path / "out", *extra))
    for word in words:
        assert word in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_resuming_with_another_block_size_is_refused(refused_data, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(pretrain_argv(refused_data, out, "--save_steps", "1")) == 0
    err = one_line_error(capsys, pretrain_argv(refused_data, out, "--max_steps", "3", "--resume_from_checkpoint", "last",
                                      "--block_size", "12"))
    assert "--block_size 16" in err and "--block_size 12" in err


def test_train_tokenizer_into_an_existing_file_is_refused(refused_data, tmp_path, capsys):
    target = tmp_path / "tok.json"
    target.write_text("{}")
    err = one_line_error(capsys, ["train-tokenizer", str(refused_data / "train.jsonl"), "-o", str(target), "--vocab_size", "300"])
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
    from hf_lookaround.decoding import group_generate

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
