"""LoRA adaptation (`pretrain --init_from SRC --lora_r R`, issue 39) under the training setups a full run has:

- DDP, two processes on the CPU (torchrun, gloo): the adapters train, the replicas stay equal, rank 0 alone saves a
  merged plain checkpoint, and a run killed on both ranks resumes from its last checkpoint to the uninterrupted
  run's losses and weights (that run with gradient checkpointing, which changes neither). The runs go through
  ``tests/dist_worker.py pretrain`` (the command unchanged, recording each rank's batches, saves and final weights,
  and killing itself where asked);
- gradient checkpointing, bf16 autocast and torch.compile in one process, against the plain run;
- FSDP2 (``fully_shard`` on 2 CPU processes: accelerate enables FSDP only on accelerators), with full and with
  sharded state dicts, and FSDP1's refusal."""

import gzip
import json
import textwrap

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

    # 2. the same run killed on both ranks before step 4, then resumed from its last checkpoint (checkpoint-2); this
    # one with (reentrant) gradient checkpointing under DDP, which must change no loss or weight either
    out = tmp_path / "killed"
    checkpointed = ("--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs", '{"use_reentrant": true}')
    proc = torchrun(*lora_args(sources, out, *checkpointed), env={"LOOKAROUND_TEST_KILL": "train:3"}, check=False)
    assert proc.returncode != 0 and not (out / "trainer_state.json").exists()
    assert checkpointing.last_complete_checkpoint(out) == out / "checkpoint-2"
    torchrun(*lora_args(sources, out, *checkpointed, "--resume_from_checkpoint", "last"))
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


FSDP_WORKER = textwrap.dedent(
    """
    import copy, json, os, sys, torch, torch.distributed as dist
    from types import SimpleNamespace
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    import hf_lookaround as H
    from hf_lookaround.adaptation import LORA_STATE_NAME, load_lora_checkpoint, lora_checkpoint_state, merge_lora, with_lora
    from hf_lookaround.training.checkpointing import is_sharded
    from hf_lookaround.objectives import make_plan

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]
    lora = SimpleNamespace(lora_r=4, lora_alpha=None, lora_dropout=0.0, lora_target_modules=None)

    def build():
        torch.manual_seed(0)
        return with_lora(H.LookAroundForPreTraining(H.LookAroundConfig.from_preset("tiny", vocab_size=100)), lora)

    def shard(model):  # as examples/accelerate/fsdp.yaml: each LookAroundLayer a unit, the rest in the root
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)

    def full(model):  # the full state dict FULL_STATE_DICT gathers (on rank 0; the others get none)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    model = build()
    reference = copy.deepcopy(model)  # one process, unsharded, same batch: the same update
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    shard(model)
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(1))  # every rank: the same batch
    plan = make_plan("dar", [12, 12], 12, generator=torch.Generator().manual_seed(2), t=2)
    batch = dict(input_ids=ids, group_ids=plan.group_ids, labels=torch.where(plan.is_target, ids, -100))
    for net in (model, reference):
        optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(2):  # two steps: after the first, lora_B (zero at the start) is non-zero
            net(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    result = {"sharded": is_sharded(model), "merged_in_place": merge_lora(model)}
    state = full(model)
    folder = os.path.join(out, "checkpoint-2")
    if rank == 0:
        expected = reference.state_dict()
        result["trained_like_one_process"] = max(float((state[k] - expected[k]).abs().max()) for k in expected)
        result["moved"] = sorted(k for k in before if not torch.equal(before[k], state[k]))
        merged, adapters = lora_checkpoint_state(model, state)  # what LookAroundTrainer._save writes
        merge_lora(reference)  # peft's merge, in place, on the unsharded model
        result["merged_keys_equal"] = sorted(merged) == sorted(reference.state_dict())
        result["merge_error"] = max(float((merged[k] - v).abs().max()) for k, v in reference.state_dict().items())
        os.makedirs(folder)
        save_file({k: v.contiguous() for k, v in merged.items()}, os.path.join(folder, "model.safetensors"))
        save_file({k: v.contiguous() for k, v in adapters.items()}, os.path.join(folder, LORA_STATE_NAME))
    dist.barrier()
    fresh = shard(build())  # a resumed run: a new sharded model loads the checkpoint on every rank
    load_lora_checkpoint(fresh, folder)
    again = full(fresh)
    if rank == 0:
        result["resume_error"] = max(float((again[k] - state[k]).abs().max()) for k in state)
        result["resume_keys_equal"] = sorted(again) == sorted(state)
        json.dump(result, open(os.path.join(out, "result.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_lora_under_fsdp2_trains_saves_the_merge_and_resumes(tmp_path):
    """accelerate enables FSDP only on accelerators, so this runs FSDP2 itself (`fully_shard`, as
    examples/accelerate/fsdp.yaml wraps) on 2 CPU processes (gloo) with the pieces a LoRA run's Trainer calls: the
    adapters train beside frozen weights in one unit as in one process, the checkpoint's merge computed from the
    gathered full state dict equals peft's in-place merge, the in-place merge is skipped on shards, and a fresh
    sharded model loads the checkpoint back on every rank."""
    script = tmp_path / "worker.py"
    script.write_text(FSDP_WORKER)
    # the shared launcher: it launches again, once, when another test took torchrun's free port meanwhile
    done = torchrun(str(tmp_path), script=script, env={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["sharded"] and result["merged_in_place"] is False
    assert result["trained_like_one_process"] < 1e-5
    assert result["moved"] and all(".lora_" in k for k in result["moved"]), result["moved"]  # frozen stayed frozen
    assert result["merged_keys_equal"] and result["merge_error"] < 1e-6
    assert result["resume_keys_equal"] and result["resume_error"] == 0


SHARDED_WORKER = textwrap.dedent(
    """
    import copy, json, os, sys, torch, torch.distributed as dist
    from types import SimpleNamespace
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType
    from transformers import TrainingArguments
    import hf_lookaround as H
    from hf_lookaround.adaptation import LORA_STATE_NAME, merge_lora, with_lora
    from hf_lookaround.training.checkpointing import full_state_dict
    from hf_lookaround.objectives import make_plan
    from hf_lookaround.training.pretraining import LookAroundTrainer

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]
    lora = SimpleNamespace(lora_r=4, lora_alpha=None, lora_dropout=0.0, lora_target_modules=None)

    def build(seed):
        torch.manual_seed(seed)
        return with_lora(H.LookAroundForPreTraining(H.LookAroundConfig.from_preset("tiny", vocab_size=100)), lora)

    def shard(model):  # as examples/accelerate/fsdp.yaml: each LookAroundLayer a unit, the rest in the root
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)

    def train(net, steps, seed):  # every rank: the same batches
        optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
        for step in range(steps):
            ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(seed + step))
            plan = make_plan("dar", [12, 12], 12, generator=torch.Generator().manual_seed(seed + step), t=2)
            net(input_ids=ids, group_ids=plan.group_ids, labels=torch.where(plan.is_target, ids, -100)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    def trainer(model, kind):
        # the real LookAroundTrainer; accelerate enables FSDP only on accelerators, so its FSDP2 plugin is set here
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none")
        t = LookAroundTrainer(model=model, args=args)
        t.is_fsdp_enabled = True
        t.accelerator.state.fsdp_plugin = SimpleNamespace(fsdp_version=2, state_dict_type=kind)
        return t

    model = shard(build(0))
    train(model, 2, 1)  # after the first step lora_B (zero at the start) is non-zero
    saver = trainer(model, StateDictType.SHARDED_STATE_DICT)
    checkpoint = os.path.join(out, "checkpoint-2")
    saver.save_model(checkpoint, _internal_call=True)  # every rank, as Trainer._save_checkpoint calls it
    merge_lora(model)  # the end of training (skipped on shards), then the final save
    saver.save_model()
    state = full_state_dict(model)  # what the files must hold
    result = {}
    if rank == 0:
        peft = build(0)  # peft's in-place merge of the same trained state, in one process
        peft.load_state_dict(state)
        merge_lora(peft)
        expected = peft.state_dict()
        final, saved = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(checkpoint, "model.safetensors"))
        result["final_keys_equal"] = sorted(final) == sorted(expected)
        result["merge_error"] = max(float((final[k] - v).abs().max()) for k, v in expected.items())
        result["checkpoint_error"] = max(float((saved[k] - v).abs().max()) for k, v in expected.items())
        result["moved"] = any(not torch.equal(v, state[k.replace(".weight", ".base_layer.weight")])
                              for k, v in expected.items() if k.replace(".weight", ".base_layer.weight") in state)
        result["files"] = sorted(os.listdir(out)), sorted(os.listdir(checkpoint))
    # a resumed run: a new sharded model (other adapters) loads the checkpoint through the trainer on every rank,
    # then it and the original go on for two steps
    fresh = shard(build(7))
    trainer(fresh, StateDictType.SHARDED_STATE_DICT)._load_from_checkpoint(checkpoint)
    loaded = full_state_dict(fresh)
    train(model, 2, 10)
    train(fresh, 2, 10)
    ahead, resumed = full_state_dict(model), full_state_dict(fresh)
    if rank == 0:
        result["load_error"] = max(float((loaded[k] - v).abs().max()) for k, v in state.items())
        result["resume_error"] = max(float((resumed[k] - v).abs().max()) for k, v in ahead.items())
        result["went_on"] = any(not torch.equal(ahead[k], state[k]) for k in state)
        json.dump(result, open(os.path.join(out, "result.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_lora_under_fsdp2_sharded_state_dict_saves_merged_and_resumes(tmp_path):
    """FSDP's SHARDED_STATE_DICT, where Trainer.save_model writes no weights: LookAroundTrainer.save_model, called
    on both ranks of a sharded LoRA model (2 CPU processes, gloo, `fully_shard` as the recipe wraps), gathers the
    full state dict on every rank and writes the merged model, equal to peft's in-place merge of the same state, in
    a checkpoint (with its adapter file) and as the final model (without); a fresh sharded model with other
    adapters loads the checkpoint through the trainer and goes on exactly as the run it came from."""
    script = tmp_path / "worker.py"
    script.write_text(SHARDED_WORKER)
    done = torchrun(str(tmp_path), script=script, env={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    final_files, checkpoint_files = result["files"]
    assert "model.safetensors" in final_files and LORA_STATE_NAME not in final_files
    assert {"model.safetensors", "config.json", LORA_STATE_NAME} <= set(checkpoint_files)
    assert result["final_keys_equal"] and result["moved"]  # plain names; the adapters changed the weights
    assert result["merge_error"] < 1e-6 and result["checkpoint_error"] < 1e-6
    assert result["load_error"] == 0  # the adapters (and every weight) came back on every rank
    assert result["went_on"] and result["resume_error"] < 1e-6


def test_only_a_lora_run_under_sharded_state_dict_gathers_its_own_state():
    """What LookAroundTrainer.save_model hands to _save beside Trainer's own save: nothing without FSDP or under
    FULL_STATE_DICT (Trainer gathers there), and, under SHARDED_STATE_DICT, the state of a model that no training
    sharded (a LoRA run's final model written again from its checkpoint, merged in place) as it is."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import StateDictType

    from hf_lookaround import LookAroundConfig, LookAroundForPreTraining
    from hf_lookaround.adaptation import merge_lora, with_lora
    from hf_lookaround.training.checkpointing import state_for_sharded_save

    def lora_state_for_sharded_save(trainer):  # what LookAroundTrainer.save_model asks for a LoRA run's final save
        return state_for_sharded_save(trainer, "out", adapters=True)

    model = with_lora(LookAroundForPreTraining(LookAroundConfig.from_preset("tiny", vocab_size=100)),
                      SimpleNamespace(lora_r=2, lora_alpha=None, lora_dropout=0.0, lora_target_modules=None))

    def trainer(kind, fsdp=True):
        state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2, state_dict_type=kind) if fsdp else None)
        return SimpleNamespace(model=model, is_fsdp_enabled=fsdp,
                               accelerator=SimpleNamespace(state=state, unwrap_model=lambda m: m))

    assert lora_state_for_sharded_save(trainer(None, fsdp=False)) is None
    assert lora_state_for_sharded_save(trainer(StateDictType.FULL_STATE_DICT)) is None
    assert merge_lora(model)
    state = lora_state_for_sharded_save(trainer(StateDictType.SHARDED_STATE_DICT))
    assert state.keys() == model.state_dict().keys() and not any("lora_" in k for k in state)


def test_lora_under_fsdp1_is_refused_in_one_line():
    """FSDP1's flat parameters mix the frozen weights and the adapters of a unit: refused, naming FSDP2 (the recipe)."""
    from types import SimpleNamespace

    from hf_lookaround import LookAroundConfig, LookAroundForPreTraining
    from hf_lookaround.adaptation import check_lora_trainer, with_lora

    base = LookAroundForPreTraining(LookAroundConfig.from_preset("tiny", vocab_size=100))
    adapted = with_lora(LookAroundForPreTraining(LookAroundConfig.from_preset("tiny", vocab_size=100)),
                        SimpleNamespace(lora_r=2, lora_alpha=None, lora_dropout=0.0, lora_target_modules=None))

    def trainer(model, version, fsdp=True):
        plugin = SimpleNamespace(fsdp_version=version)
        return SimpleNamespace(model=model, is_fsdp_enabled=fsdp,
                               accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))

    with pytest.raises(ValueError, match="FSDP version 1") as error:
        check_lora_trainer(trainer(adapted, 1))
    assert "fsdp_version: 2" in str(error.value) and "\n" not in str(error.value)
    check_lora_trainer(trainer(adapted, 2))  # FSDP2: supported
    check_lora_trainer(trainer(adapted, 1, fsdp=False))  # DDP or one process
    check_lora_trainer(trainer(base, 1))  # full fine-tuning under FSDP1 as before


def test_lora_model_compiles_in_one_graph_with_the_eager_loss_and_gradients():
    """The adapters (peft's LoRA Linear, dropout on) add no graph break to the compiled training step, which gives
    the eager loss and gradients (`aot_eager`: dynamo's whole trace and AOTAutograd's graphs, without inductor's
    minutes of CPU code generation; see tests/test_compile.py)."""
    from types import SimpleNamespace

    import hf_lookaround as H
    from hf_lookaround import objectives
    from hf_lookaround.adaptation import with_lora
    from hf_lookaround.objectives import make_plan

    torch.manual_seed(0)
    config = H.LookAroundConfig.from_preset("tiny", vocab_size=100, attn_implementation="sdpa")
    model = with_lora(H.LookAroundForPreTraining(config), SimpleNamespace(
        lora_r=4, lora_alpha=None, lora_dropout=0.1, lora_target_modules=None)).train()
    with torch.no_grad():  # lora_B starts at zero: give the adapters a visible effect
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    ids = torch.randint(4, 100, (2, 16))
    plan = make_plan("dar", [16, 16], 16, generator=torch.Generator().manual_seed(2), t=2)
    batch = dict(input_ids=ids, group_ids=plan.group_ids, labels=torch.where(plan.is_target, ids, -100),
                 target_positions=plan.target_positions(pad_to=objectives.max_targets("dar", 16, t=2)))
    prepared = model.prepare_attention(**batch)

    def step(net):
        model.zero_grad()
        torch.manual_seed(5)  # the same dropout draws
        loss = net(**batch, prepared_attention=prepared).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            got, got_grads = step(torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    want, want_grads = step(model)
    assert want_grads and all("lora_" in name for name in want_grads)  # the adapters alone train
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_run_under_torch_compile_logs_the_eager_losses(sources, tmp_path):
    """`pretrain --lora_r --torch_compile` (backend aot_eager on the CPU): the Trainer's compiled model trains the
    adapters to the losses and merged weights of the eager run."""
    from torch._dynamo.utils import counters
    from test_adaptation_pretrain import pretrain

    common = ("--lora_r", "4", "--learning_rate", "5e-2", "--max_steps", "3", "--logging_steps", "1", "--seed", "3")
    assert pretrain(sources, tmp_path / "eager", "llama", "vmlm", *common) == 0
    torch._dynamo.reset()
    counters.clear()
    try:
        assert pretrain(sources, tmp_path / "compiled", "llama", "vmlm", *common, "--torch_compile", "true",
                        "--torch_compile_backend", "aot_eager") == 0
        assert counters["stats"]["unique_graphs"] > 0  # dynamo really compiled the step
    finally:
        torch._dynamo.reset()
    (eager, reference), (weights, curve) = trained(tmp_path / "eager"), trained(tmp_path / "compiled")
    assert sorted(reference) == [1, 2, 3] and len(set(reference.values())) == 3
    assert [curve[s] for s in (1, 2, 3)] == pytest.approx([reference[s] for s in (1, 2, 3)], rel=1e-5)
    assert weights.keys() == eager.keys() and not any("lora_" in k for k in weights)  # merged, as eager
    for name in eager:
        torch.testing.assert_close(weights[name], eager[name], rtol=1e-4, atol=1e-5)


def test_lora_run_under_bf16_autocast_trains_near_fp32_and_saves_fp32_merged_weights(sources, tmp_path):
    """`--bf16 true` (autocast; the adapters and weights stay fp32): the losses follow the fp32 run's to bf16's
    precision, and the merged checkpoint is fp32, moved in the adapted projections only."""
    from test_adaptation_pretrain import pretrain

    common = ("--lora_r", "4", "--learning_rate", "5e-2", "--max_steps", "3", "--logging_steps", "1", "--seed", "3")
    assert pretrain(sources, tmp_path / "fp32", "llama", "dar_one_stream", *common) == 0
    assert pretrain(sources, tmp_path / "bf16", "llama", "dar_one_stream", *common, "--bf16", "true") == 0
    (_, reference), (weights, curve) = trained(tmp_path / "fp32"), trained(tmp_path / "bf16")
    assert curve != reference  # autocast really ran in bf16
    assert [curve[s] for s in (1, 2, 3)] == pytest.approx([reference[s] for s in (1, 2, 3)], rel=2e-2)
    before = load_file(tmp_path / "bf16" / "init_from" / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in weights.values())
    moved = {k for k in before if not torch.equal(before[k], weights[k])}
    assert moved and all(k.rsplit(".", 2)[-2].endswith("_proj") for k in moved), moved
