"""Loading a checkpoint (hub/load.py, hub/weights.py): what once loaded into a wrong model or crashed with a
traceback (issue 30, section 3, items 4, 5 and 7):
missing or unexpected tensors, NaN weights, a vision checkpoint given to a text command, a config of another
model_type, removed config fields or a changed weight shape. Every command that loads a model goes through
``hub.load.load_checkpoint`` (or ``hub.weights.check_local_checkpoint`` where it reads no model: push, a resume),
so each must refuse with one line.

Each test damages a copy of conftest's tiny finished run (`copy`)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_lookaround import cli
from hf_lookaround.training import checkpointing
from conftest import one_line_error

FIXTURES = __import__("pathlib").Path(__file__).resolve().parent / "fixtures"




def rewrite_weights(folder, change) -> None:
    """Rewrite ``folder/model.safetensors`` as ``change(tensors)`` returns it (a valid file, only other tensors)."""
    path = folder / "model.safetensors"
    tensors = change(load_file(str(path)))
    save_file(tensors, str(path), metadata={"format": "pt"})


def drop_three(tensors):
    for key in ("model.layers.1.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.weight", "model.norm.weight"):
        del tensors[key]
    return tensors


DAMAGE = {
    "3 tensors missing": (drop_three, "3 tensor(s) missing (model.layers.1.self_attn.v_proj.weight, "
                                       "model.layers.1.mlp.up_proj.weight, model.norm.weight)"),
    "an unexpected tensor": (lambda t: {**t, "model.layers.9.extra.weight": torch.zeros(3)},
                             "1 unexpected tensor(s) (model.layers.9.extra.weight)"),
    "all NaN": (lambda t: {k: torch.full_like(v, float("nan")) for k, v in t.items()}, "NaN or infinite values"),
    "one inf": (lambda t: {**t, "model.norm.weight": t["model.norm.weight"].index_fill(0, torch.tensor([3]),
                                                                                        float("inf"))},
                "NaN or infinite values in 1 tensor(s) ("),  # (model.)norm.weight: the base model has no prefix
}


def command_argv(command, checkpoint, tmp_path, bbc_text_dir, make_args):
    """The arguments of ``command`` reading the model in ``checkpoint`` (each would run on an intact one)."""
    data = FIXTURES / "reviews"
    return {
        "generate": ["generate", str(checkpoint), "--num_tokens", "3", "--device", "cpu"],
        "perplexity": ["perplexity", "--model_name_or_path", str(checkpoint), "--dataset", str(bbc_text_dir),
                       "--protocol", "masked", "--max_documents", "1", "--positions_per_window", "2",
                       "--device", "cpu", "--output_dir", str(tmp_path / "ppl")],
        "probe": ["probe", "--model_name_or_path", str(checkpoint), "--dataset", str(data), "--max_train_samples", "8",
                  "--max_eval_samples", "8", "--device", "cpu", "--output_dir", str(tmp_path / "probe")],
        "glue": ["glue", "--model_name_or_path", str(checkpoint), "--train_file", str(data / "train.jsonl"),
                 "--validation_file", str(data / "validation.jsonl"), "--max_train_samples", "8",
                 "--max_eval_samples", "8", "--max_seq_length", "32", "--max_steps", "1", "--do_train", "--do_eval",
                 "--report_to", "none", "--save_strategy", "no", "--use_cpu", "--output_dir", str(tmp_path / "glue")],
        "push": ["push", str(checkpoint), "me/tiny", "--dry-run", str(tmp_path / "preview")],
        "pretrain --model_name_or_path": ["pretrain", *make_args(tmp_path / "again", "--model_name_or_path",
                                                                 str(checkpoint))],
    }[command]


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("command", ["generate", "perplexity", "probe", "glue", "push", "pretrain --model_name_or_path"])
def test_every_command_refuses_missing_unexpected_or_non_finite_weights(copy, tmp_path, bbc_text_dir, make_args, capsys,
                                                                        command, damage):
    # before: missing tensors were re-initialised and unexpected ones dropped with a warning (rc 0, text from random
    # layers); all-NaN weights generated "" with rc 0
    change, expected = DAMAGE[damage]
    rewrite_weights(copy, change)
    line = one_line_error(capsys, command_argv(command, copy, tmp_path, bbc_text_dir, make_args))
    assert line.startswith(f"hf-lookaround {command.split()[0]}: error: ") and str(copy) in line and expected in line


@pytest.mark.parametrize("damage", ["3 tensors missing", "all NaN"])
def test_a_resume_refuses_a_checkpoint_whose_weights_were_replaced(copy, make_args, capsys, damage):
    # a checkpoint whose marker agrees with its files (damaged, then marked again): Trainer loads the weights
    # non-strictly (missing tensors kept at their initial values, with a log line) and went on
    checkpoint = copy / "checkpoint-4"
    rewrite_weights(checkpoint, DAMAGE[damage][0])
    checkpointing.mark_complete(checkpoint, 4, 1, {"block_size": 32})
    assert checkpointing.checkpoint_problems(checkpoint) == []
    line = one_line_error(capsys, ["pretrain", *make_args(copy, "--resume_from_checkpoint", "last", max_steps=6)])
    assert "checkpoint-4" in line and DAMAGE[damage][1] in line
    assert not (copy / "checkpoint-6").exists()


# ---------------------------------------------------------------------------------------------
# item 7: tracebacks from configs that do not fit, vision checkpoints given to text commands
# ---------------------------------------------------------------------------------------------
def edit_config(folder, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("command", ["generate", "perplexity", "pretrain --model_name_or_path"])
def test_a_config_of_another_model_type_is_not_an_hf_lookaround_checkpoint(copy, tmp_path, bbc_text_dir, make_args,
                                                                           capsys, command):
    # before: KeyError: 'swiglu' (generate), 'BertConfig' object has no attribute 'validate_lookaround' (pretrain)
    edit_config(copy, lambda c: c.update(model_type="bert"))
    line = one_line_error(capsys, command_argv(command, copy, tmp_path, bbc_text_dir, make_args))
    assert "not an hf_lookaround checkpoint" in line and "'bert'" in line and "model_type 'lookaround'" in line


@pytest.mark.parametrize("command", ["generate", "probe"])
def test_a_removed_config_field_or_a_changed_shape_is_named(copy, tmp_path, bbc_text_dir, make_args, capsys, command):
    # before: transformers' RuntimeError suggesting ignore_mismatched_sizes (which would re-initialise the layers)
    edit_config(copy, lambda c: c.pop("intermediate_size"))
    line = one_line_error(capsys, command_argv(command, copy, tmp_path, bbc_text_dir, make_args))
    assert "6 tensor(s) of another shape: model.layers.0.mlp.down_proj.weight [32, 64] (config.json: [32, 3072])" in line
    assert "config.json lacks intermediate_size" in line and "ignore_mismatched_sizes" not in line

    restored = copy.parent / "reshaped"
    __import__("shutil").copytree(copy, restored)
    edit_config(restored, lambda c: c.update(intermediate_size=64))
    rewrite_weights(restored, lambda t: {**t, "model.layers.1.mlp.up_proj.weight": torch.zeros(64, 33)})
    line = one_line_error(capsys, command_argv(command, restored, tmp_path, bbc_text_dir, make_args))
    assert "1 tensor(s) of another shape: model.layers.1.mlp.up_proj.weight [64, 33] (config.json: [64, 32])" in line


@pytest.fixture
def vision_checkpoint(tiny_model, tmp_path):
    from hf_lookaround import LookAroundViTForPreTraining

    out = tmp_path / "vit"
    tiny_model(LookAroundViTForPreTraining).save_pretrained(out)
    return out


@pytest.mark.parametrize("command", ["generate", "perplexity", "probe", "pretrain --model_name_or_path"])
def test_a_vision_checkpoint_given_to_a_text_command_says_which_command_reads_it(vision_checkpoint, tmp_path,
                                                                                  bbc_text_dir, make_args, capsys,
                                                                                  command):
    # before: 'LookAroundViTForPreTraining' object has no attribute 'lm_head' (generate); ~200 config classes
    # listed (perplexity)
    line = one_line_error(capsys, command_argv(command, vision_checkpoint, tmp_path, bbc_text_dir, make_args))
    assert f"{vision_checkpoint} is a vision checkpoint" in line
    assert f"hf-lookaround vision sample --model {vision_checkpoint}" in line and len(line) < 400


def test_vision_sample_refuses_a_text_checkpoint_and_reads_a_vision_one(finished_run, vision_checkpoint, tmp_path,
                                                                         capsys):
    line = one_line_error(capsys, ["vision", "sample", "--model", str(finished_run), "--out", str(tmp_path / "g.png")])
    assert "is a text checkpoint" in line and "hf-lookaround generate" in line
    assert cli.main(["vision", "sample", "--model", str(vision_checkpoint), "--num_images", "2",
                     "--out", str(tmp_path / "g.png")]) == 0


def test_an_intact_checkpoint_loads_through_every_head(finished_run):
    from hf_lookaround.hub.load import load_pretrained

    for head in ("base", "pretraining", "masked-lm", "causal-lm", "sequence-classification"):
        assert load_pretrained(finished_run, head=head) is not None
