"""FSDP2 (`fully_shard`, what examples/accelerate/fsdp.yaml does) on the CPU with gloo: one process, and two for
SHARDED_STATE_DICT's saves and resume.

fully_shard swaps the model's class for a subclass `FSDP<Name>` defined in torch. A full state dict saved
from the sharded model must still carry our remote code and an `auto_map` naming our classes, and the
evaluators must still recognise the two-stream head.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from conftest import HUNG_CHILD_SECONDS  # a guard against a hung child, not a speed test

WORKER = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    import hf_lookaround as H
    from hf_lookaround.evaluation.perplexity import is_two_stream
    from hf_lookaround.objectives import make_plan

    dist.init_process_group("gloo", rank=0, world_size=1)
    out = sys.argv[1]
    torch.manual_seed(0)
    model = H.LookAroundForPreTraining(H.LookAroundConfig.from_preset("tiny", vocab_size=100))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(4, 100, (2, 12))
    plan = make_plan("dar", [12, 12], 12, t=2)
    loss = model(input_ids=ids, group_ids=plan.group_ids, labels=torch.where(plan.is_target, ids, -100)).loss
    loss.backward()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    expected = {k: v.detach().clone() for k, v in state.items()}  # save_pretrained may consume `state`
    model.save_pretrained(out, state_dict=state)
    torch.save(expected, os.path.join(out, "expected.pt"))
    json.dump({"class": type(model).__name__, "two_stream": is_two_stream(model)}, open(os.path.join(out, "worker.json"), "w"))
    dist.destroy_process_group()
    """
)


def test_fsdp2_full_state_dict_saves_our_remote_code_and_reloads(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]

    worker = json.loads((out / "worker.json").read_text())
    assert worker["class"] == "FSDPLookAroundForPreTraining"  # the swap really happened
    assert worker["two_stream"] is True

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LookAroundForPreTraining"]
    assert config["auto_map"]["AutoModelForPreTraining"] == "modeling_lookaround.LookAroundForPreTraining"
    files = sorted(p.name for p in out.iterdir())
    assert "modeling_lookaround.py" in files
    assert not [f for f in files if f.startswith("_fsdp")], files  # no torch internals as "remote code"

    from transformers import AutoModelForPreTraining

    import hf_lookaround  # noqa: F401  (registers the Auto classes)

    reloaded = AutoModelForPreTraining.from_pretrained(out)
    expected = torch.load(out / "expected.pt")
    assert set(reloaded.state_dict()) == set(expected), set(reloaded.state_dict()) ^ set(expected)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


SHARDED_RUN_WORKER = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, TrainingArguments, get_constant_schedule
    import hf_lookaround as H
    from hf_lookaround.objectives import make_plan
    from hf_lookaround.training import checkpointing
    from hf_lookaround.training.checkpointing import full_state_dict
    from hf_lookaround.training.pretraining import (DataArguments, LookAroundTrainer, ObjectiveArguments,
                                                    save_final_model)

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]

    def build(seed, shard=True):
        torch.manual_seed(seed)
        model = H.LookAroundForPreTraining(H.LookAroundConfig.from_preset("tiny", vocab_size=100))
        if shard:  # as examples/accelerate/fsdp.yaml: each LookAroundLayer a unit, the rest in the root
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        return model

    def train(t, steps, first):  # each rank its own batch, as a DistributedSampler gives
        for step in range(first, first + steps):
            seed = 100 * step + rank
            ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(seed))
            plan = make_plan("dar", [12, 12], 12, generator=torch.Generator().manual_seed(seed), t=2)
            labels = torch.where(plan.is_target, ids, -100)
            t.model(input_ids=ids, group_ids=plan.group_ids, labels=labels).loss.backward()
            t.optimizer.step()
            t.lr_scheduler.step()
            t.optimizer.zero_grad()
        t.state.global_step = first + steps - 1

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 100)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")))

    def trainer(model, **kwargs):
        # the real LookAroundTrainer and accelerate's FSDP2 plugin under SHARDED_STATE_DICT; accelerate enables FSDP
        # only on accelerators, so the model is sharded above and the plugin set here
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none", do_train=True, max_steps=4, **kwargs)
        t = LookAroundTrainer(model=model, args=args, processing_class=tokenizer)
        t.is_fsdp_enabled = True
        t.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
        t.model_wrapped, t.current_flos = model, 0
        t.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        t.lr_scheduler = get_constant_schedule(t.optimizer)
        return t

    result = {}
    run = trainer(build(0))
    train(run, 2, 1)
    run._save_checkpoint(run.model, trial=None)  # what Trainer calls at save_steps, on every rank
    at_checkpoint = full_state_dict(run.model)
    train(run, 2, 3)
    save_final_model(run, ObjectiveArguments(), DataArguments(dataset_name="made-up"))  # pretrain's, every rank
    ahead = full_state_dict(run.model)

    # a resumed run: `last` through the resume checks, then the weights and optimizer through the trainer (accelerate
    # reads the shards), and the same two steps
    resumed = trainer(build(7), resume_from_checkpoint="last")
    decision = checkpointing.decide_resume(resumed.args, resumed.model.config, None)
    resumed._load_from_checkpoint(decision.checkpoint, resumed.model_wrapped)
    resumed._load_optimizer_and_scheduler(decision.checkpoint)
    loaded = full_state_dict(resumed.model)
    train(resumed, 2, 3)
    went_on = full_state_dict(resumed.model)

    # a final model written again from the checkpoint (an unsharded model reads the shards in full on every rank)
    again = trainer(build(9, shard=False))
    again._load_from_checkpoint(decision.checkpoint)
    again.save_model(os.path.join(out, "again"))
    # a finished run evaluated again: the final model (no FSDP files) read into a model no training sharded
    finished = trainer(build(11, shard=False))
    finished._load_from_checkpoint(out)
    reread = finished.model.state_dict()
    if rank == 0:
        final = load_file(os.path.join(out, "model.safetensors"))
        rewritten = load_file(os.path.join(out, "again", "model.safetensors"))
        error = lambda got, want: max(float((v - want[k]).abs().max()) for k, v in got.items())
        tied = set(again.model._tied_weights_keys or {})  # save_pretrained leaves out a weight tied to another
        result.update(
            decision=[os.path.basename(decision.checkpoint), decision.action],
            final_problems=checkpointing.final_model_problems(out),
            files=sorted(os.listdir(out)), checkpoint_files=sorted(os.listdir(decision.checkpoint)),
            final_keys_equal=sorted(final) == sorted(ahead), final_error=error(final, ahead),
            moved=any(not torch.equal(ahead[k], v) for k, v in at_checkpoint.items()),
            load_error=error(loaded, at_checkpoint), resume_error=error(went_on, ahead),
            rewritten_keys_equal=set(rewritten) <= set(at_checkpoint) and set(at_checkpoint) - set(rewritten) <= tied,
            rewritten_error=error(rewritten, at_checkpoint), reread_error=error(reread, ahead))
        torch.save(ahead, os.path.join(out, "expected.pt"))
        json.dump(result, open(os.path.join(out, "result.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_sharded_state_dict_checkpoints_resume_exactly_and_the_final_model_is_full(tmp_path):
    """FSDP2 under SHARDED_STATE_DICT without LoRA (2 CPU processes, gloo, `fully_shard`; the real LookAroundTrainer
    with accelerate's plugin): a checkpoint keeps Trainer's shards and gets config.json and the tokenizer but no
    gathered weights; `last` passes the resume checks, and the weights and optimizer read back through the trainer
    go on for two steps exactly as the run did; the final model is the gathered full state dict, loadable with
    AutoModelForCausalLM; a final model written again from the checkpoint holds the checkpoint's weights, and a
    finished run evaluated again reads the final model back."""
    from test_distributed import torchrun

    script = tmp_path / "worker.py"
    script.write_text(SHARDED_RUN_WORKER)
    out = tmp_path / "out"
    done = torchrun(str(out), script=script, env={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    assert result["decision"] == ["checkpoint-2", "train"]
    checkpoint = set(result["checkpoint_files"])
    assert {"config.json", "tokenizer.json", "pytorch_model_fsdp_0", "optimizer_0", "scheduler.pt",
            "checkpoint_complete.json"} <= checkpoint
    assert "model.safetensors" not in checkpoint  # no gather at a checkpoint: the shards are its weights
    assert {"config.json", "model.safetensors", "modeling_lookaround.py", "README.md",
            "final_model_complete.json"} <= set(result["files"])
    assert result["final_problems"] == []  # the final model's marker lists what was written
    assert result["final_keys_equal"] and result["final_error"] == 0
    assert result["moved"] and result["load_error"] == 0 and result["resume_error"] < 1e-6
    assert result["rewritten_keys_equal"] and result["rewritten_error"] == 0
    assert result["reread_error"] == 0

    from transformers import AutoModelForCausalLM

    import hf_lookaround  # noqa: F401  (registers the Auto classes)

    expected = torch.load(out / "expected.pt")
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()
    shared = [k for k in expected if k in state]
    assert len(shared) > 10
    for name in shared:
        assert torch.equal(state[name], expected[name]), name


def test_sharded_state_dict_under_fsdp1_is_refused_in_one_line():
    """FSDP1's flat parameters cannot be gathered into the final model here: refused up front, naming FSDP2 and
    FULL_STATE_DICT; FSDP2, FULL_STATE_DICT and runs without FSDP pass."""
    from types import SimpleNamespace

    import pytest

    from hf_lookaround.training.checkpointing import check_sharded_saving

    def trainer(version, kind, fsdp=True):
        plugin = SimpleNamespace(fsdp_version=version, state_dict_type=kind)
        state = SimpleNamespace(fsdp_plugin=plugin)
        return SimpleNamespace(is_fsdp_enabled=fsdp, accelerator=SimpleNamespace(state=state))

    with pytest.raises(ValueError, match="FSDP version 1") as error:
        check_sharded_saving(trainer(1, "StateDictType.SHARDED_STATE_DICT"))
    assert "FULL_STATE_DICT" in str(error.value) and "fsdp_version: 2" in str(error.value)
    assert "\n" not in str(error.value)
    check_sharded_saving(trainer(2, "StateDictType.SHARDED_STATE_DICT"))
    check_sharded_saving(trainer(1, "StateDictType.FULL_STATE_DICT"))
    check_sharded_saving(trainer(1, "StateDictType.SHARDED_STATE_DICT", fsdp=False))


def test_a_sharded_checkpoint_without_readable_shards_is_refused_and_loaders_name_the_merge(tmp_path):
    """A checkpoint whose FSDP shards have no readable metadata (a cut save) is refused in one line before any
    load; a loader given a sharded checkpoint (no model.safetensors) says how to merge the shards."""
    import pytest

    from hf_lookaround.hub.weights import SHARDED_MODEL_DIR, check_weights
    from hf_lookaround.training.checkpointing import check_sharded_weights, sharded_weights

    folder = tmp_path / "checkpoint-2"
    (folder / SHARDED_MODEL_DIR).mkdir(parents=True)
    (folder / SHARDED_MODEL_DIR / "__0_0.distcp").write_bytes(b"\0" * 8)  # the shards, without their .metadata
    assert sharded_weights(folder) == folder / SHARDED_MODEL_DIR
    with pytest.raises(ValueError, match="model shards") as error:
        check_sharded_weights(folder)
    assert "\n" not in str(error.value) and "another checkpoint" in str(error.value)
    with pytest.raises(ValueError, match="accelerate merge-weights") as error:
        check_weights(folder)
    assert "\n" not in str(error.value)
    (folder / "model.safetensors").write_bytes(b"")  # full weights beside the shards: those are read
    assert sharded_weights(folder) is None
