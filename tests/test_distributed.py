"""Two processes on the CPU (torchrun, gloo): pretraining, per-rank data and plans, gradients, every
head under DDP, and resuming after a SIGKILL. Also the single-process pieces of checkpointing.

The two-process tests launch ``tests/dist_worker.py`` with ``python -m torch.distributed.run
--standalone --nproc_per_node 2`` and check the world size inside."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_lookaround.training import checkpointing
from hf_lookaround.objectives import make_collator
from hf_lookaround.training.pretraining import gradient_accumulation_for, run
from hf_lookaround.cli.pretrain import parse_args
from conftest import HUNG_CHILD_SECONDS, PLAN_WORDS  # a guard against a hung child, not a speed test

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,hidden_dropout_prob=0.1"
STEPS, SAVE_EVERY = 10, 3  # 24 blocks, 2 per rank and step: 6 steps per epoch, so the run crosses an epoch
CHECKPOINTS = [3, 6, 9, 10]  # every SAVE_EVERY steps, and at the end


def torchrun(*args, env=None, check=True, timeout=HUNG_CHILD_SECONDS, script=WORKER):
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and "address already in use" in (proc.stdout + proc.stderr).lower():
        # the free port torchrun picked was taken by another process meanwhile: launch again, once
        proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small JSON Lines corpus of made-up sentences and a BPE tokenizer trained on it."""
    from hf_lookaround.data.tokenization import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(PLAN_WORDS) for _ in range(rng.randint(40, 90))) + "." for _ in range(60)]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_tokenizer(docs, vocab_size=300, output_dir=root / "tok")
    return path, root / "tok"


def pretrain_args(corpus, output_dir, *extra):
    data, tok = corpus
    return ["pretrain", "--train_files", str(data), "--tokenizer_name", str(tok), "--preset", "tiny",
            "--config_overrides", TINY, "--block_size", "32", "--validation_split_percentage", "10",
            "--max_train_samples", "24", "--objective", "vmlm", "--output_dir", str(output_dir),
            "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3",
            "--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY), "--seed", "13", "--logging_steps", "1",
            "--use_cpu", "true", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
            # the worker records each rank's batches as the plan collator made them (not compacted)
            "--drop_unread_content", "false", *extra]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def same_weights(a, b) -> bool:
    wa, wb = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference_run(corpus, tmp_path_factory):
    """An uninterrupted two-process run, recording what each rank trained on."""
    out = tmp_path_factory.mktemp("reference")
    record = out / "record"
    record.mkdir()
    torchrun(*pretrain_args(corpus, out / "run", "--do_train", "--do_eval", "--max_eval_samples", "8",
                            "--perplexity_max_documents", "1", "--report_to", "tensorboard"),
             env={"LOOKAROUND_TEST_RECORD": str(record)})
    return out / "run", record


# ------------------------------------------------------------------------------------------------
# two processes
# ------------------------------------------------------------------------------------------------
def test_two_process_pretraining_finishes_and_saves_once(reference_run):
    out, record = reference_run
    rows = {r: read_jsonl(record / f"rank{r}.jsonl") for r in (0, 1)}
    assert all(row["world_size"] == 2 for r in rows for row in rows[r])
    # Trainer wrapped the model in DDP with the fast setting (pretrain's default)
    assert all(row["find_unused_parameters"] is False for r in rows for row in rows[r])
    assert [row["step"] for row in rows[0]] == [row["step"] for row in rows[1]] == list(range(STEPS))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # only rank 0 writes the model (checkpoints and the final save), each once; one TensorBoard log
    assert not (record / "saves1.txt").exists()
    saves = (record / "saves0.txt").read_text().split()
    expected = [str(out / f"checkpoint-{s}") for s in CHECKPOINTS] + [str(out)]
    assert sorted(saves) == sorted(expected)
    # TensorBoard files are named events.out.tfevents.TIME.HOST.PID.N: all written by one process
    events = list((out / "runs").rglob("events.out.tfevents*"))
    assert events and len({p.name.split(".")[-2] for p in events}) == 1
    metrics = json.loads((out / "all_results.json").read_text())
    assert "eval_loss" in metrics and "train_loss" in metrics
    # every checkpoint is complete, with one RNG state per rank
    assert [p.name for p in checkpointing.list_checkpoints(out)] == [f"checkpoint-{s}" for s in CHECKPOINTS]
    for step in CHECKPOINTS:
        ckpt = out / f"checkpoint-{step}"
        assert checkpointing.is_complete(ckpt)
        manifest = json.loads((ckpt / checkpointing.COMPLETE_MARKER).read_text())
        assert manifest["world_size"] == 2 and {"rng_state_0.pth", "rng_state_1.pth"} <= set(manifest["files"])


def test_ranks_see_disjoint_blocks_and_draw_their_own_plans(reference_run, corpus):
    from transformers import AutoTokenizer

    _, record = reference_run
    rows = {r: read_jsonl(record / f"rank{r}.jsonl") for r in (0, 1)}
    assert [rows[r][0]["collator_rank"] for r in (0, 1)] == [0, 1]
    epoch0 = {r: [tuple(x) for row in rows[r] if row["epoch"] == 0 for x in row["input_ids"]] for r in (0, 1)}
    # within an epoch each block goes to exactly one rank, and the two ranks cover the training set
    assert not set(epoch0[0]) & set(epoch0[1])
    assert len(set(epoch0[0]) | set(epoch0[1])) == len(epoch0[0]) + len(epoch0[1]) == 24
    # each rank's plans are the collator's plans for that rank: recomputing them with the other rank differs
    tok = AutoTokenizer.from_pretrained(corpus[1])
    differs = 0
    for r in (0, 1):
        for row in rows[r]:
            features = [{"input_ids": x} for x in row["input_ids"]]
            draw = {}
            for q in (0, 1):
                collator = make_collator("vmlm", tok, seed=13, mask_ratio_range=(0.15, 0.3), process_rank=q)
                collator.set_epoch(row["epoch"])
                draw[q] = collator(features)["group_ids"].tolist()
            assert draw[r] == row["group_ids"]
            differs += draw[1 - r] != row["group_ids"]
    assert differs == 2 * STEPS


@pytest.fixture(scope="module")
def ddp_report(tmp_path_factory):
    """Plain DDP loops (tests/dist_worker.py ddp): one step's gradients, and every head for 3 steps."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun("ddp", str(out / "grads.json"), str(out / "heads.json"))
    return json.loads((out / "grads.json").read_text()), json.loads((out / "heads.json").read_text())


def test_gradients_of_two_ranks_equal_one_process_on_both_halves(ddp_report):
    results, _ = ddp_report
    assert [r["world_size"] for r in results] == [2, 2]
    # the halves hold different numbers of targets: the loss form matters (sum over the global count)
    assert results[0]["rank_targets"] != results[1]["rank_targets"]
    for r in results:
        assert r["max_abs_grad"] > 1e-3
        assert r["max_abs_diff"] <= 1e-5 * r["max_abs_grad"] + 1e-7


def test_every_head_trains_under_ddp_without_find_unused_parameters(ddp_report):
    _, report = ddp_report
    assert report["world_size"] == 2
    heads = ["LookAroundForPreTraining", "LookAroundForCausalLM", "LookAroundForMaskedLM",
             "LookAroundForSequenceClassification"]
    for head in heads:
        result = report["results"].get(head, {"ok": False, "error": "not reached"})
        assert result["ok"], f"{head}: {result.get('error')}"
        assert len(result["losses"]) == 3 and all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["moved"] == result["trainable"] and result["replicas_equal"]


def test_sigkill_during_a_save_and_mid_training_then_resume_gives_the_uninterrupted_weights(
        reference_run, corpus, tmp_path):
    reference, _ = reference_run
    out = tmp_path / "run"
    # save_total_limit 1: rotation must never delete the complete checkpoint in favour of a broken one
    args = pretrain_args(corpus, out, "--do_train", "--report_to", "none", "--save_total_limit", "1")
    resume = [*args, "--resume_from_checkpoint", "last"]

    # 1. killed while saving checkpoint-6: its weights are written, its trainer state is not
    proc = torchrun(*args, env={"LOOKAROUND_TEST_KILL": "save:6"}, check=False)
    assert proc.returncode != 0 and not (out / "model.safetensors").exists()
    assert (out / "checkpoint-6" / "model.safetensors").exists()
    assert not (out / "checkpoint-6" / "trainer_state.json").exists()
    assert not checkpointing.is_complete(out / "checkpoint-6")
    assert checkpointing.last_complete_checkpoint(out) == out / "checkpoint-3"

    # 2. resumed from checkpoint-3 (the debris of checkpoint-6 removed), then killed between saves
    proc = torchrun(*resume, env={"LOOKAROUND_TEST_KILL": "train:8"}, check=False)
    assert proc.returncode != 0 and not (out / "model.safetensors").exists()
    assert [p.name for p in checkpointing.list_checkpoints(out)] == ["checkpoint-6"]
    assert checkpointing.is_complete(out / "checkpoint-6")

    # 3. resumed from checkpoint-6, runs to the end
    torchrun(*resume)
    assert [p.name for p in checkpointing.list_checkpoints(out)] == ["checkpoint-10"]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == STEPS
    assert same_weights(out, reference)


# ------------------------------------------------------------------------------------------------
# one process: checkpoint bookkeeping and errors
# ------------------------------------------------------------------------------------------------
def fake_checkpoint(root, step, complete=True, **config):
    folder = Path(root) / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if complete:
        checkpointing.mark_complete(folder, step, world_size=1)
    return folder


def test_last_and_rotation_see_complete_checkpoints_only(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False), (10, True), (12, False)):
        fake_checkpoint(tmp_path, step, complete)
    assert checkpointing.last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert checkpointing.resolve_resume_checkpoint("last", tmp_path) == str(tmp_path / "checkpoint-10")
    with pytest.raises(ValueError, match="not a complete checkpoint.*newest complete one.*checkpoint-10"):
        checkpointing.resolve_resume_checkpoint(str(tmp_path / "checkpoint-12"), tmp_path)
    deleted = checkpointing.rotate_complete_checkpoints(tmp_path, 2, keep=[tmp_path / "checkpoint-2"])
    assert [p.name for p in deleted] == ["checkpoint-4"]
    assert [p.name for p in checkpointing.complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10"]
    moved = checkpointing.remove_incomplete_checkpoints(tmp_path)
    assert [p.name for p in moved] == ["incomplete-checkpoint-6", "incomplete-checkpoint-12"]
    assert all(p.is_dir() for p in moved)  # moved aside, never deleted
    assert [p.name for p in checkpointing.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10"]
    fake_checkpoint(tmp_path, 6, complete=False)  # a second broken save of the same step
    assert [p.name for p in checkpointing.remove_incomplete_checkpoints(tmp_path)] == ["incomplete-checkpoint-6-1"]
    empty = tmp_path / "empty"
    fake_checkpoint(empty, 5, complete=False)
    with pytest.raises(ValueError, match="no complete checkpoint.*only incomplete ones"):
        checkpointing.resolve_resume_checkpoint("last", empty)


def test_clear_errors_for_batch_sizes_and_foreign_checkpoints(corpus, tmp_path):
    assert gradient_accumulation_for(64, 4, 2) == 8
    with pytest.raises(ValueError, match="not a multiple of --per_device_train_batch_size 4 x 2 process"):
        gradient_accumulation_for(36, 4, 2)
    base = pretrain_args(corpus, tmp_path / "a", "--do_train", "--report_to", "none")[1:]
    with pytest.raises(ValueError, match="--global_batch_size 3 is not a multiple"):
        run(*parse_args([*base, "--global_batch_size", "3"]))
    with pytest.raises(ValueError, match="implies --gradient_accumulation_steps 2, but 3 was given"):
        run(*parse_args([*base, "--global_batch_size", "4", "--gradient_accumulation_steps", "3"]))
    # a checkpoint of another objective or size is refused before training
    run(*parse_args([*base, "--max_steps", "3"]))
    foreign = [*pretrain_args(corpus, tmp_path / "b", "--do_train", "--report_to", "none")[1:],
               "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-3")]
    with pytest.raises(ValueError, match="another objective or model size.*objective: checkpoint 'vmlm', this run 'ar'"):
        run(*parse_args([*foreign, "--objective", "ar"]))
    with pytest.raises(ValueError, match="hidden_size: checkpoint 32, this run 64"):
        run(*parse_args([*foreign, "--config_overrides", TINY.replace("hidden_size=32", "hidden_size=64")]))



def test_resuming_with_another_world_size_warns(tmp_path, caplog):
    from hf_lookaround import LookAroundConfig

    config = LookAroundConfig.from_preset("tiny", vocab_size=100, objective="ar")
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    config.save_pretrained(folder)
    checkpointing.mark_complete(folder, 4, world_size=2)
    with caplog.at_level("WARNING", logger="hf_lookaround.training.checkpointing"):
        checkpointing.check_resume_compatible(folder, config, world_size=2)
        assert not caplog.records
        checkpointing.check_resume_compatible(folder, config, world_size=4)
    assert "saved by 2 process(es), with 4" in caplog.text


def test_resuming_in_the_other_stream_form_is_refused(tmp_path):
    """A two-stream ar checkpoint resumed with --ar_form single_stream would switch the predicting stream
    mid-run: refused, as another objective is."""
    from hf_lookaround import LookAroundConfig

    config = LookAroundConfig.from_preset("tiny", vocab_size=100, objective="ar")
    config.prediction_stream = "query"
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    config.save_pretrained(folder)
    checkpointing.mark_complete(folder, 4, world_size=1)
    checkpointing.check_resume_compatible(folder, config, world_size=1)
    config.prediction_stream = "content"
    with pytest.raises(ValueError, match="prediction_stream: checkpoint 'query', this run 'content'"):
        checkpointing.check_resume_compatible(folder, config, world_size=1)
    # a checkpoint saved before configs recorded the stream still resumes
    saved = json.loads((folder / "config.json").read_text())
    saved.pop("prediction_stream")
    (folder / "config.json").write_text(json.dumps(saved))
    checkpointing.check_resume_compatible(folder, config, world_size=1)


# ------------------------------------------------------------------------------------------------
# launch recipes
# ------------------------------------------------------------------------------------------------
RECIPES = Path(__file__).resolve().parents[1] / "examples" / "accelerate"


@pytest.mark.parametrize("name,distributed,processes", [("single_gpu", "NO", 1), ("ddp", "MULTI_GPU", 2),
                                                        ("fsdp", "FSDP", 2)])
def test_accelerate_recipes_load_as_accelerate_reads_them(name, distributed, processes, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.launch import prepare_multi_gpu_env

    from hf_lookaround import LookAroundConfig, LookAroundForPreTraining

    path = RECIPES / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type.value == distributed and config.mixed_precision == "bf16"
    assert config.num_processes == processes
    # what `accelerate launch --config_file` does with it, up to starting the processes
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    assert args.mixed_precision == "bf16" and args.num_processes == processes
    if name == "single_gpu":
        return
    env = prepare_multi_gpu_env(args)
    if name == "ddp":
        assert args.multi_gpu and "ACCELERATE_USE_FSDP" not in env
        return
    assert args.use_fsdp and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.state_dict_type.name == "FULL_STATE_DICT"
    model = LookAroundForPreTraining(LookAroundConfig.from_preset("tiny", vocab_size=100))
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [type(m).__name__ for m in model.modules() if policy(m)]
    assert wrapped == ["LookAroundLayer"] * model.config.num_hidden_layers
    assert set(model._no_split_modules) == {"LookAroundLayer"}
