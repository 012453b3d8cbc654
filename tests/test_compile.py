"""The compiled training step: masks prepared outside the graph, block sparsity, skipped unread work, auto kernel.

CPU notes: FlexAttention has no backward on the CPU, so flex is checked forward-only here (its gradient audit runs
on the GPU in benchmarks/gpu_bench.py). Inductor's CPU code generation takes minutes per graph on two cores, so most
compiled checks use the `aot_eager` backend: it still traces the whole step with dynamo (any graph break fails
`fullgraph=True`) and runs AOTAutograd's forward and backward graphs; one test uses inductor itself.
"""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

import hf_lookaround as H
from hf_lookaround import objectives
import hf_lookaround.models.lookaround.masking_lookaround as masking  # the one mask rule
import hf_lookaround.models.lookaround.modeling_lookaround as modeling
from hf_lookaround.leakcheck import audit_two_stream
from hf_lookaround.training.unread_content import drop_unread_content
from hf_lookaround.objectives import make_plan

VOCAB = 61  # tiny_config's vocabulary (tests/conftest.py)
BERT_LIKE = dict(position_embedding_type="absolute", norm_type="layernorm", hidden_act="gelu", norm_position="post",
                 attention_bias=True, mlp_bias=True)
CONFIGS = {"llama": {}, "bert": BERT_LIKE}
# every objective of the table, with small plan parameters where its defaults need long sequences
PARAMS = {**{name: {} for name in objectives.names()}, "dar": {"t": 2}, "mlm": {"mask_ratio": 0.15}, "gvp": {"num_groups": 4}}


@pytest.fixture
def eager_flex():
    """FlexAttention's unfused reference kernel: transformers compiles flex per shape otherwise (minutes on 2 cores)."""
    with torch.compiler.set_stance("force_eager"):
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    # static graphs per shape (what the GPU benchmark compiles; dynamic flex graphs do not build on the CPU)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


@pytest.fixture
def make(tiny_model):
    """The shared tiny pretraining model in training mode, Llama-like or BERT-like, for sequences of ``seq_len``."""

    def build(config="llama", impl="sdpa", seq_len=32, **overrides):
        return tiny_model(H.LookAroundForPreTraining, impl, seed=0, max_position_embeddings=seq_len,
                          **{**CONFIGS[config], **overrides}).train()

    return build


def batch_for(objective, seq_len=32, lengths=(32, 27), seed=0, width=None):
    """A collator-like batch: targets padded to a static width (the objective's largest count, ``max_targets``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (len(lengths), seq_len), generator=g)
    mask = (torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]).long()
    plan = make_plan(objective, list(lengths), seq_len, generator=g, **PARAMS[objective])
    width = width or objectives.max_targets(objective, seq_len, **PARAMS[objective])
    return dict(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids,
                labels=torch.where(plan.is_target, ids, -100), target_positions=plan.target_positions(pad_to=width))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------ compiled step, every objective
@pytest.mark.parametrize("config", ["llama", "bert"])
def test_compiled_step_with_prepared_masks_every_objective_sdpa(config, make):
    """fullgraph (no graph break), one graph per target width, same loss and gradients as eager; every objective of
    the table (``objectives.names()``), so a new one is covered without editing this test."""
    model = make(config).train()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    seen_widths = set()
    for objective in objectives.names():
        batch = batch_for(objective, seed=len(objective))
        width = batch["target_positions"].shape[1]
        prepared = model.prepare_attention(**batch)
        model.zero_grad()
        want = model(**batch, prepared_attention=prepared).loss
        want.backward()
        want_grads = grads(model)
        model.zero_grad()
        # a new plan of an already-compiled width must not recompile: the masks are graph inputs
        with torch._dynamo.config.patch(error_on_recompile=width in seen_widths):
            got = compiled(**batch, prepared_attention=prepared).loss
        got.backward()
        seen_widths.add(width)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name, grad in grads(model).items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=f"{objective} {name}")


@pytest.mark.parametrize("config", ["llama", "bert"])
@torch.no_grad()
def test_compiled_flex_forward_with_a_prebuilt_block_mask(config, make):
    """The BlockMask is built outside the graph and every layer reuses it; the graph has no break and a new
    batch's BlockMask does not recompile."""
    model = make(config, "flex_attention").eval()
    reference = make(config, "sdpa").eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    seen_widths = set()
    for seed, objective in enumerate(objectives.names()):
        batch = batch_for(objective, seed=seed)
        width = batch["target_positions"].shape[1]
        prepared = model.prepare_attention(**batch)
        assert isinstance(prepared.mask, BlockMask) and isinstance(prepared.query_mask, BlockMask)
        with torch._dynamo.config.patch(error_on_recompile=width in seen_widths):
            got = compiled(**batch, prepared_attention=prepared)
        seen_widths.add(width)
        want = reference(**batch)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
        slots = batch["target_positions"] >= 0
        torch.testing.assert_close(got.logits[slots], want.logits[slots], rtol=1e-4, atol=1e-5)


def test_inductor_compiles_the_bert_like_masked_step(make):
    """Issue 9's failure: inductor on the BERT-like masked step (targets padded to ceil(0.15 T), absolute positions
    for T + M rows). Real inductor code generation here, not aot_eager (one layer: it takes a while on the CPU)."""
    model = make("bert", seq_len=64, num_hidden_layers=1).train()
    compiled = torch.compile(model, dynamic=False)
    for objective, width in [("mlm", math.ceil(0.15 * 64))]:
        batch = batch_for(objective, seq_len=64, lengths=(64, 64, 50, 64), width=width)
        model.zero_grad()
        want = model(**batch).loss
        want.backward()
        want_grads = grads(model)
        model.zero_grad()
        got = compiled(**batch, prepared_attention=model.prepare_attention(**batch)).loss
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads(model)["model.layers.0.mlp.up_proj.weight"],
                                   want_grads["model.layers.0.mlp.up_proj.weight"], rtol=1e-3, atol=1e-5)


def test_compiled_step_without_target_positions_has_no_graph_break(make):
    """Labels alone: the compiled graph takes every position as a slot instead of sizing slots on the host."""
    model = make().train()
    batch = batch_for("mlm")
    del batch["target_positions"]
    want = model(**batch).loss
    got = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")(**batch).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ leaks on the prepared/compiled path
@pytest.mark.parametrize("objective", objectives.names())
def test_compiled_step_leaks_nothing(objective, make):
    model = make(seq_len=40).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [40, 33]
    ids = torch.randint(4, VOCAB, (2, 40), generator=g)
    mask = (torch.arange(40)[None] < torch.tensor(lengths)[:, None]).long()
    plan = make_plan(objective, lengths, 40, generator=g, **PARAMS.get(objective, {}))  # others: their defaults
    report = audit_two_stream(model, ids, mask, plan.group_ids, plan.is_target, compiled=True,
                              compile_kwargs=dict(backend="aot_eager", dynamic=False))
    assert report.leaks == [] and report.blind == [], (report.leaks[:3], report.blind[:3])
    assert report.targets_checked == int(plan.is_target.sum()) > 0


def test_the_compiled_audit_catches_a_leak(monkeypatch, make):
    """The compiled path reads the one mask rule too: a rule that lets the query stream see its own rank is caught."""
    monkeypatch.setattr(masking, "may_attend", lambda q, k, strict, valid: valid & (k <= q))
    model = make(seq_len=40).eval()
    ids, mask = torch.randint(4, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0)), torch.ones(1, 40).long()
    plan = make_plan("dar", [40], 40, t=2, generator=torch.Generator().manual_seed(0))
    report = audit_two_stream(model, ids, mask, plan.group_ids, plan.is_target, compiled=True,
                              compile_kwargs=dict(backend="aot_eager", dynamic=False))
    assert report.leaks


@torch.no_grad()
def test_prepared_flex_forward_ignores_tokens_it_must_not_see(eager_flex, make):
    """Forward-only leak check of the prebuilt-BlockMask path (no flex backward on the CPU)."""
    model = make("bert", "flex_attention").eval()
    batch = batch_for("gvp", seed=4)
    base = model(**batch, prepared_attention=model.prepare_attention(**batch)).logits
    group_ids, slots = batch["group_ids"], batch["target_positions"]
    for b in range(2):
        m = int((slots[b] >= 0).sum()) // 2
        target = int(slots[b, m])
        changed = dict(batch, input_ids=batch["input_ids"].clone())
        invisible = (group_ids[b] >= group_ids[b, target]) | (batch["attention_mask"][b] == 0)
        changed["input_ids"][b, invisible] = (changed["input_ids"][b, invisible] + 7) % (VOCAB - 4) + 4
        out = model(**changed, prepared_attention=model.prepare_attention(**changed)).logits
        torch.testing.assert_close(out[b, m], base[b, m], rtol=0, atol=1e-6)
        changed["input_ids"][b, ~invisible] = (changed["input_ids"][b, ~invisible] + 3) % (VOCAB - 4) + 4
        out = model(**changed, prepared_attention=model.prepare_attention(**changed)).logits
        assert (out[b, m] - base[b, m]).abs().max() > 1e-4


# ------------------------------------------------------------------------------------ block sparsity
def block_occupancy(dense: torch.Tensor, block: int) -> torch.Tensor:
    """(B, 1, L, K) bool -> (B, nq, nk) bool: does any pair in the block attend."""
    batch, _, rows, keys = dense.shape
    padded = torch.nn.functional.pad(dense[:, 0], (0, -keys % block, 0, -rows % block))
    return padded.unflatten(1, (-1, block)).unflatten(3, (-1, block)).any(4).any(2)


@pytest.mark.parametrize("objective", ["ar", "dar", "gvp", "mlm"])
def test_block_mask_is_exactly_as_sparse_as_the_plan(objective, make):
    seq_len = 512
    model = make(seq_len=seq_len, impl="flex_attention").model
    g = torch.Generator().manual_seed(0)
    plan = make_plan(objective, [seq_len, 400], seq_len, generator=g, **PARAMS[objective])
    width = math.ceil(0.15 * seq_len) if objective == "mlm" else seq_len
    kwargs = dict(input_ids=torch.zeros(2, seq_len, dtype=torch.long), group_ids=plan.group_ids,
                  attention_mask=(torch.arange(seq_len)[None] < torch.tensor([[seq_len], [400]])).long(),
                  target_positions=plan.target_positions(pad_to=width))
    prepared = model.prepare_attention(**kwargs, content_output=False)
    model.set_attn_implementation("sdpa")
    dense = model.prepare_attention(**kwargs, content_output=False)
    sees = dense.row_factor[:, :, 0, 0].bool()[:, None, :, None]
    for block_mask, rule in [(prepared.mask, dense.mask & sees), (prepared.query_mask, dense.query_mask & sees[:, :, seq_len:])]:
        block = block_mask.BLOCK_SIZE[0]
        stored = block_mask.to_dense()[:, 0].bool()  # (B, nq, nk): blocks the kernel visits
        want = block_occupancy(rule, block)
        assert torch.equal(stored[:, : want.shape[1], : want.shape[2]], want), "BlockMask differs from the plan's blocks"
    if objective in ("ar", "dar"):
        # content and query-stream rows are both block-causal: about half of the blocks are skipped
        # (4 key blocks: a block-causal mask leaves 6 of 16 blocks empty, 37.5%)
        assert prepared.mask.sparsity() > 30 and prepared.query_mask.sparsity() > 30


# ------------------------------------------------------------------------------------ skipped work
@pytest.mark.parametrize("config", ["llama", "bert"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_skipping_the_last_content_layer_keeps_loss_and_gradients(config, impl, make):
    model = make(config, impl).train()
    batch = batch_for("dar", seed=3)
    results = []
    for keep in (True, False):
        model.zero_grad()
        out = model(**batch, return_last_hidden_state=keep)
        out.loss.backward()
        results.append((out, grads(model)))
    (full, full_grads), (skipped, skipped_grads) = results
    assert full.last_hidden_state is not None and skipped.last_hidden_state is None
    torch.testing.assert_close(skipped.loss, full.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(skipped.logits, full.logits, rtol=1e-5, atol=1e-6)
    assert full_grads.keys() == skipped_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(skipped_grads[name], full_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_skipping_runs_the_last_layer_on_the_query_rows_only(make):
    """The skip is real: the last layer's MLP sees M query rows, not T + M."""
    model = make().train()
    batch = batch_for("mlm")
    rows_seen = []
    hook = model.model.layers[-1].mlp.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[1]))
    try:
        model(**batch)  # labels: the default skips
        model(**batch, return_last_hidden_state=True)
    finally:
        hook.remove()
    width = batch["target_positions"].shape[1]
    assert rows_seen == [width, 32 + width]


@torch.no_grad()
def test_skipping_with_flex_keeps_the_logits(eager_flex, make):
    model = make("bert", "flex_attention").eval()
    batch = batch_for("vmlm")
    full = model(**batch, return_last_hidden_state=True)
    skipped = model(**batch)
    torch.testing.assert_close(skipped.logits, full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skipped.loss, full.loss)


# ------------------------------------------------------------------------------------ kernel by length
@torch.no_grad()
def test_auto_attention_picks_flex_from_the_threshold(monkeypatch, eager_flex, make):
    monkeypatch.setattr(masking, "FLEX_ATTENTION_MIN_KEYS", 48)
    model = make(impl=modeling.AUTO_ATTENTION, seq_len=64).eval()
    reference = make(impl="sdpa", seq_len=64).eval()
    for seq_len, kind in [(32, torch.Tensor), (64, BlockMask)]:
        batch = batch_for("dar", seq_len=seq_len, lengths=(seq_len, seq_len - 5))
        prepared = model.prepare_attention(**batch)
        assert isinstance(prepared.mask, kind)
        torch.testing.assert_close(model(**batch, prepared_attention=prepared).loss, reference(**batch).loss,
                                   rtol=1e-5, atol=1e-5)
    assert modeling.resolve_attention_implementation("sdpa", 10**6) == "sdpa"


def test_a_prepared_mask_of_another_batch_is_refused(make):
    model = make()
    batch = batch_for("dar")
    prepared = model.prepare_attention(**batch_for("mlm"))
    with pytest.raises(ValueError, match="prepared_attention was built for"):
        model(**batch, prepared_attention=prepared)


def test_trainer_under_torch_compile_builds_the_masks_outside_the_model(tmp_path, make):
    from transformers import TrainingArguments

    from hf_lookaround.training.pretraining import LookAroundTrainer

    model = make().train()
    batch = batch_for("dar")
    seen = []
    forward = model.forward

    def spy(**kwargs):
        seen.append(kwargs.get("prepared_attention"))
        return forward(**kwargs)

    model.forward = spy
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, use_cpu=True, report_to=[])
    trainer = LookAroundTrainer(model=model, args=args)
    loss = trainer.compute_loss(model, dict(batch))
    assert isinstance(seen[0], modeling.PreparedAttention)
    torch.testing.assert_close(loss, forward(**batch).loss)


# ------------------------------------------------------------------------------------ content rows nobody reads
@pytest.mark.parametrize("config", ["llama", "bert"])
@pytest.mark.parametrize("objective", ["mlm", "vmlm", "gvp", "dar"])
def test_dropping_unread_content_rows_keeps_loss_and_gradients(config, objective, make):
    """The top rank's content rows (masked tokens, GVP's last group) and padding feed no prediction."""
    model = make(config).train()
    batch = batch_for(objective, seed=5)
    compact = drop_unread_content(batch)
    top = torch.where(batch["attention_mask"] != 0, batch["group_ids"], -1).amax(-1)
    kept = ((batch["group_ids"] < top[:, None]) & (batch["attention_mask"] != 0)).sum(-1)
    assert compact["input_ids"].shape[1] == int(kept.max()) < batch["input_ids"].shape[1]
    results = []
    for inputs in (batch, compact):
        model.zero_grad()
        out = model(**inputs)
        out.loss.backward()
        results.append((out, grads(model)))
    (full, full_grads), (dropped, dropped_grads) = results
    torch.testing.assert_close(dropped.loss, full.loss, rtol=1e-5, atol=1e-6)
    slots = batch["target_positions"] >= 0  # the same slots, in the same order: every prediction is unchanged
    torch.testing.assert_close(dropped.logits[slots], full.logits[slots], rtol=1e-5, atol=1e-5)
    assert full_grads.keys() == dropped_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(dropped_grads[name], full_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_dropped_content_batch_compiles_with_a_fixed_width_and_refuses_a_narrow_one(make):
    model = make("bert").train()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    width = 32 - round(0.15 * 27)  # every sequence of these lengths keeps at most this many rows
    for seed in range(2):
        batch = batch_for("mlm", seed=seed)
        compact = drop_unread_content(batch, content_width=width)
        assert compact["input_ids"].shape[1] == width
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            got = compiled(**compact, prepared_attention=model.prepare_attention(**compact)).loss
        torch.testing.assert_close(got, model(**batch).loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="content_width=10 is smaller"):
        drop_unread_content(batch, content_width=10)


def test_trainer_finds_only_the_labels_argument():
    """Trainer treats every forward argument named like a label as one each batch must hold (else no eval loss)."""
    from transformers.utils import find_labels

    assert find_labels(H.LookAroundForPreTraining) == ["labels"]


def test_dropped_content_width_rounds_up_to_a_multiple():
    batch = batch_for("gvp", seed=2)
    exact = drop_unread_content(batch)["input_ids"].shape[1]
    rounded = drop_unread_content(batch, width_multiple=8)["input_ids"].shape[1]
    assert rounded % 8 == 0 and exact <= rounded < exact + 8


def test_the_trainer_compacts_in_the_collator_counts_the_same_targets_and_compiles_static_graphs(tmp_path, make):
    """--drop_unread_content: the training collator compacts each batch (DropUnreadContent), the Trainer counts
    the same loss positions in it (num_items_in_batch, for gradient accumulation), and under --torch_compile the
    accelerator compiles one static graph per width (dynamic=False)."""
    from transformers import TrainingArguments

    from hf_lookaround.training.pretraining import LookAroundTrainer
    from hf_lookaround.training.unread_content import DropUnreadContent

    full = batch_for("vmlm", seed=4)
    collator = DropUnreadContent(lambda features: full, width_multiple=4)
    compact = collator([])
    assert compact["input_ids"].shape[1] % 4 == 0 and compact["input_ids"].shape[1] < full["input_ids"].shape[1]
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, use_cpu=True, report_to=[])
    trainer = LookAroundTrainer(model=make(), args=args)
    assert trainer.accelerator.state.dynamo_plugin.dynamic is False
    counted = trainer._get_num_items_in_batch([compact, compact], torch.device("cpu"))
    assert int(counted) == 2 * int((full["labels"] != -100).sum()) > 0
    assert int(trainer._get_num_items_in_batch([full], torch.device("cpu"))) == int((full["labels"] != -100).sum())


def test_compile_in_one_process_on_several_gpus_is_refused_with_the_launch_command(tmp_path, monkeypatch):
    """Issue 23 item 7: DataParallel splits the batch but not the prepared masks; the run names accelerate launch."""
    from transformers import TrainingArguments

    from hf_lookaround.training.pretraining import check_launch

    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, use_cpu=True, report_to=[])
    check_launch(args)  # one device: fine
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"accelerate launch --config_file examples/accelerate/ddp.yaml "
                                         r"--num_processes 2 -m hf_lookaround.cli pretrain"):
        check_launch(args)
    check_launch(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))  # eager DataParallel runs


def test_dropping_unread_content_is_on_by_default_for_the_masked_objectives_and_gvp_only(tmp_path):
    from hf_lookaround.cli.pretrain import parse_args
    from hf_lookaround.training.pretraining import without_unread_content
    from hf_lookaround.training.unread_content import DropUnreadContent

    def collator(*extra):
        _, _, objective_args, training_args = parse_args(["--train_files", "x", "--output_dir", str(tmp_path),
                                                           "--use_cpu", "true", *extra])
        return without_unread_content(object(), objective_args, training_args, block_size=1024)

    for objective in ("mlm", "vmlm"):
        wrapped = collator("--objective", objective, "--torch_compile", "true")
        assert isinstance(wrapped, DropUnreadContent) and wrapped.width_multiple == 64
        assert isinstance(collator("--objective", objective), DropUnreadContent)
        assert not isinstance(collator("--objective", objective, "--drop_unread_content", "false"), DropUnreadContent)
        assert not isinstance(collator("--objective", objective, "--masked_form", "single_stream"), DropUnreadContent)
    for objective in ("ar", "dar"):
        assert not isinstance(collator("--objective", objective), DropUnreadContent)
    assert not isinstance(collator("--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5"), DropUnreadContent)
    wrapped = collator("--objective", "gvp", "--torch_compile", "true")
    assert isinstance(wrapped, DropUnreadContent) and wrapped.width_multiple == 256  # a quarter of the block
    assert not isinstance(collator("--objective", "gvp", "--drop_unread_content", "false"), DropUnreadContent)
    assert isinstance(collator("--objective", "dar", "--drop_unread_content"), DropUnreadContent)


@pytest.mark.parametrize("objective,flags", [("vmlm", {}), ("mlm", {"mask_ratio": 0.3}), ("span", {})])
def test_the_commands_drop_keeps_one_width_for_every_batch_of_real_text(objective, flags, tokenizer, bbc_text_dir):
    """Under --torch_compile the command wraps masked collators with the objective's bound on the rows they keep:
    every batch of a run has one width (one compiled graph), and a batch that keeps more is widened, never cut."""
    from hf_lookaround.data.text import load_texts
    from hf_lookaround.training.pretraining import (
        LookAroundTrainingArguments,
        ObjectiveArguments,
        build_collators,
        without_unread_content,
    )

    block = 512
    objective_args = ObjectiveArguments(objective=objective, **flags)
    collator, _ = build_collators(objective_args, tokenizer, seed=0, block_size=block, static_shapes=True)
    args = LookAroundTrainingArguments(output_dir="unused", torch_compile=True, use_cpu=True, report_to=[])
    dropping = without_unread_content(collator, objective_args, args, block)
    ids = [tokenizer.bos_token_id] + [i for text in load_texts(bbc_text_dir / "train.jsonl.gz")
                                      for i in tokenizer(text, add_special_tokens=False).input_ids]
    blocks = [{"input_ids": ids[i : i + block]} for i in range(0, len(ids) - block, block)]
    blocks = [{"input_ids": [tokenizer.bos_token_id] + b["input_ids"][1:]} for b in blocks]
    widths = [dropping(blocks[i : i + 8])["input_ids"].shape[1] for i in range(0, len(blocks) - 8, 8)]
    assert len(widths) >= 4 and set(widths) == {dropping.min_width} and dropping.min_width < block
    # a batch whose rows are mostly special tokens (never masked) keeps more rows: widened to the next multiple
    special = [{"input_ids": [tokenizer.bos_token_id] + [tokenizer.eos_token_id] * 300 + b["input_ids"][301:]}
               for b in blocks[:8]]
    wide = dropping(special)
    assert wide["input_ids"].shape[1] > dropping.min_width
    kept = (wide["attention_mask"] != 0).sum(1)
    assert int(kept.max()) <= wide["input_ids"].shape[1]
