"""LoRA adaptation (`pretrain --init_from SRC --lora_r R`, issue 39) under DDP: two processes on the CPU (torchrun,
gloo) train the adapters, keep the replicas equal, save a merged plain checkpoint from rank 0 only, and a run killed
on both ranks resumes from its last checkpoint to the uninterrupted run's losses and weights.

The runs go through ``tests/dist_worker.py pretrain`` (the command unchanged, recording each rank's batches, saves and
final weights, and killing itself where asked)."""

import gzip
import json

import pytest
import torch
from safetensors.torch import load_file
from test_adaptation import save_source, source_texts
from test_distributed import torchrun

from hf_lookaround.adaptation import LORA_STATE_NAME
from hf_lookaround.training import checkpointing

TARGETS = ("q_proj", "v_proj", "down_proj")  # a subset: the other projections must come out unchanged


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ddp")
    save_source(root / "llama", "llama_gqa_untied_linear")
    with gzip.open(root / "train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in source_texts(count=24, seed=1))
    return root


def lora_args(sources, out, *extra):
    return ["pretrain", "--init_from", str(sources / "llama"), "--train_files", str(sources / "train.jsonl.gz"),
            "--block_size", "16", "--objective", "dar", "--group_size", "2", "--dar_form", "single_stream",
            "--lora_r", "4", "--lora_target_modules", ",".join(TARGETS), "--lora_dropout", "0.1",
            "--per_device_train_batch_size", "2", "--max_train_samples", "8", "--max_steps", "4",
            "--learning_rate", "5e-2", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
            "--seed", "3", "--do_train", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0", "--output_dir", str(out), *extra]


def losses(out):
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def test_lora_under_ddp_trains_saves_merged_once_and_resumes_after_a_kill(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    # 1. uninterrupted, recording what each rank did
    straight, record = tmp_path / "straight", tmp_path / "record"
    record.mkdir()
    torchrun(*lora_args(sources, straight), env={"LOOKAROUND_TEST_RECORD": str(record)})
    rows = {r: [json.loads(line) for line in (record / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    assert all(row["world_size"] == 2 and row["find_unused_parameters"] is False for r in rows for row in rows[r])
    assert rows[0][0]["input_ids"] != rows[1][0]["input_ids"]  # each rank trains on its own blocks
    # the ranks end with the same (merged) weights; rank 0 alone wrote checkpoints and the final model
    assert json.loads((record / "weights0.json").read_text()) == json.loads((record / "weights1.json").read_text())
    assert (record / "saves0.txt").is_file() and not (record / "saves1.txt").exists()
    checkpoint = straight / "checkpoint-2"
    assert json.loads((checkpoint / checkpointing.COMPLETE_MARKER).read_text())["world_size"] == 2
    assert {p.name for p in checkpoint.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert any("lora_A" in k for k in load_file(checkpoint / LORA_STATE_NAME))

    # the final model: plain names, and only the targeted projections moved (merged in); all of them did
    final = load_file(straight / "model.safetensors")
    before = load_file(straight / "init_from" / "model.safetensors")
    assert final.keys() == before.keys() and not any("lora_" in k or "base_layer" in k for k in final)
    moved = {k for k in before if not torch.equal(before[k], final[k])}
    targeted = {k for k in before if k.rsplit(".", 2)[-2] in TARGETS}
    assert moved == targeted, moved ^ targeted
    model = AutoModelForCausalLM.from_pretrained(straight).eval()
    assert model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=2, do_sample=False, group_size=2).shape == (1, 5)

    # 2. the same run killed on both ranks before step 4, then resumed from its last checkpoint (checkpoint-2)
    out = tmp_path / "killed"
    proc = torchrun(*lora_args(sources, out), env={"LOOKAROUND_TEST_KILL": "train:3"}, check=False)
    assert proc.returncode != 0 and not (out / "trainer_state.json").exists()
    assert checkpointing.last_complete_checkpoint(out) == out / "checkpoint-2"
    torchrun(*lora_args(sources, out, "--resume_from_checkpoint", "last"))
    reference, curve = losses(straight), losses(out)
    assert sorted(reference) == [1, 2, 3, 4] and len(set(reference.values())) > 2
    assert [curve[s] for s in (3, 4)] == pytest.approx([reference[s] for s in (3, 4)], abs=1e-5)
    again = load_file(out / "model.safetensors")
    assert again.keys() == final.keys()
    for name in final:
        torch.testing.assert_close(again[name], final[name], rtol=0, atol=1e-6)


def trained(out):
    """The run's final weights (merged) and its logged losses per step."""
    return load_file(out / "model.safetensors"), losses(out)


@pytest.mark.parametrize("objective,reentrant", [("dar_one_stream", False), ("vmlm", True)])
def test_lora_with_gradient_checkpointing_trains_as_without(sources, tmp_path, monkeypatch, objective, reentrant):
    """--gradient_checkpointing with --lora_r: the checkpointed layers recompute their activations and the adapters
    get the same gradients, so a few steps log the losses and end at the weights of the run without it. Both of
    torch's checkpoint kinds: with use_reentrant=True the frozen embeddings' output must require grad
    (transformers' enable_input_require_grads), or the adapters inside a layer would get none."""
    import transformers.modeling_utils as modeling_utils
    from test_adaptation_pretrain import pretrain

    calls = []
    checkpoint = modeling_utils.checkpoint
    monkeypatch.setattr(modeling_utils, "checkpoint", lambda *a, **k: calls.append(k) or checkpoint(*a, **k))
    common = ("--lora_r", "4", "--learning_rate", "5e-2", "--max_steps", "3", "--logging_steps", "1", "--seed", "3")
    assert pretrain(sources, tmp_path / "plain", "llama", objective, *common) == 0
    assert not calls
    assert pretrain(sources, tmp_path / "checkpointed", "llama", objective, *common, "--gradient_checkpointing",
                    "true", "--gradient_checkpointing_kwargs", json.dumps({"use_reentrant": reentrant})) == 0
    assert calls and all(k.get("use_reentrant") is reentrant for k in calls)  # checkpointing really ran, as asked
    (plain, reference), (weights, curve) = trained(tmp_path / "plain"), trained(tmp_path / "checkpointed")
    assert sorted(reference) == [1, 2, 3] and len(set(reference.values())) == 3
    assert [curve[s] for s in (1, 2, 3)] == pytest.approx([reference[s] for s in (1, 2, 3)], rel=1e-5)
    before = load_file(tmp_path / "plain" / "init_from" / "model.safetensors")
    assert any(not torch.equal(before[k], weights[k]) for k in before)  # the adapters trained
    for name in plain:
        torch.testing.assert_close(weights[name], plain[name], rtol=1e-4, atol=1e-5)
