"""FSDP2 (`fully_shard`, what examples/accelerate/fsdp.yaml does) on the CPU, one process with gloo.

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
