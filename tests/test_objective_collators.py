"""The shared collator battery: every objective of ``hf_lookaround.objectives`` (one module each) is tested here
with its collator's defaults and with every preset its module declares, on one tiny ragged batch.

The cases are read from the objectives table, so a new objective module is picked up with no edit to this file;
its own test file only needs what is particular to it (its distributions, its flags). What every collator owes:

- the documented keys and shapes (``data/collators.py``: two-stream ``input_ids``, ``attention_mask``,
  ``group_ids``, ``labels`` (B, T) and ``target_positions`` (B, M); a single-stream form: ``input_ids`` and
  ``labels`` of one width);
- labels exactly where the plan it drew has targets, holding the original tokens;
- the rank rule: a target is predicted from lower ranks only, so it never holds the lowest rank of its row (it
  would see nothing, or itself); checked by gradients too, with the shared leak audit on the collated batch;
- the same batch for the same seed, another for another seed (unless the plan draws nothing);
- ``max_targets`` bounds the targets of every row, and fixes ``target_positions``' width;
- bad parameters give a one-line ValueError that names what to fix.
"""

import dataclasses

import pytest
import torch

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.leakcheck import audit_two_stream
from hf_lookaround.training.pretraining import ObjectiveArguments
from conftest import BOS, EOS, TINY_TEXT, ToyTokenizer

VOCAB = TINY_TEXT["vocab_size"]  # the leak audit runs the batch through tiny_config's model
LENGTHS = (40, 31, 40, 23)  # ragged (the short rows are padded), long enough for GVP's default K = 20
DOCUMENTED = {"input_ids", "attention_mask", "group_ids", "labels", "target_positions"}
WEIGHTED = "loss_weights"  # documented too, only where the plan weighs its targets (the diffusion objectives)


def check_loss_weights(batch, plan):
    """Where a plan weighs its targets, the batch carries its weights: like the labels, positive at the targets and
    zero elsewhere; where it does not, no weights."""
    if plan.loss_weights is None:
        assert WEIGHTED not in batch
        return
    weights, labelled = batch[WEIGHTED], batch["labels"] != -100
    assert weights.shape == batch["labels"].shape and weights.is_floating_point()
    if weights.shape == plan.loss_weights.shape:
        assert torch.equal(weights, plan.loss_weights)
    else:  # a one-stream layout (bd3lm's x_t ⊕ x_0) moves the labels: the weights go with them, in order
        assert torch.equal(weights[labelled], plan.loss_weights[plan.is_target])
    assert (weights[labelled] > 0).all() and (weights[~labelled] == 0).all()


def cases():
    """``(objective, flags)``: each objective with its collator's defaults, then every preset of the table."""
    found = [pytest.param(name, None, id=f"{name}-defaults") for name in objectives.names()]
    found += [pytest.param(name, flags, id=row) for row, (name, _, flags) in objectives.presets().items()]
    return found


def two_stream_cases():
    """The cases whose batch carries plan ranks (a single-stream form's heads are audited in test_modeling)."""
    return [c for c in cases()
            if not any(k.endswith("_form") and v == "single_stream" for k, v in (c.values[1] or {}).items())]


def params_of(objective, flags):
    """``(collator params, plan params)`` of a case: the defaults, or the preset's flags read as the CLI reads them."""
    if flags is None:
        return {}, objectives.get(objective).defaults
    args = ObjectiveArguments(objective=objective, **flags)
    return args.collator_params(), args.plan_params()


def documents(seed=0):
    """Rows ``<s> w ... w </s>`` of ``LENGTHS`` (ids inside the tiny model's vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": [BOS] + torch.randint(4, VOCAB, (n - 2,), generator=g).tolist() + [EOS]} for n in LENGTHS]


def collate(objective, flags, seed=0, **extra):
    """The batch of ``documents()`` and the plan the collator drew for it."""
    collator = objectives.make_collator(objective, ToyTokenizer(VOCAB), seed=seed, **params_of(objective, flags)[0],
                                        **extra)
    drawn = []
    draw = collator._draw
    collator._draw = lambda *args: drawn.append(draw(*args)) or drawn[-1]  # a spy: the plan behind the batch
    batch = collator(documents())
    plan = drawn[0]
    return collator, batch, plan[0] if isinstance(plan, tuple) else plan  # mixture: (plan, components drawn)


def two_stream(collator) -> bool:
    return getattr(collator, "form", objectives.TWO_STREAM) == objectives.TWO_STREAM


@pytest.mark.parametrize("objective,flags", cases())
def test_keys_shapes_and_labels_where_the_plan_has_targets(objective, flags):
    collator, batch, plan = collate(objective, flags)
    original = torch.full((len(LENGTHS), max(LENGTHS)), ToyTokenizer.pad_token_id)
    for b, row in enumerate(documents()):
        original[b, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
    target = plan.is_target
    assert target.any(), "the tiny batch must have targets"
    check_loss_weights(batch, plan)
    if two_stream(collator):
        assert set(batch) - {WEIGHTED} == DOCUMENTED
        assert all(batch[k].shape == original.shape for k in DOCUMENTED - {"target_positions"})
        assert torch.equal(batch["input_ids"], original)  # two-stream: inputs unchanged
        assert torch.equal(batch["group_ids"], plan.group_ids)
        assert torch.equal(batch["labels"] != -100, target)
        assert torch.equal(batch["labels"][target], original[target])
        width = int(target.sum(1).max())
        assert batch["target_positions"].shape == (len(LENGTHS), width)
        for b in range(len(LENGTHS)):
            positions = batch["target_positions"][b]
            assert torch.equal(positions[positions >= 0], target[b].nonzero().flatten())
    else:
        assert {"input_ids", "labels"} <= set(batch) <= {"input_ids", "attention_mask", "labels", WEIGHTED}
        assert batch["labels"].shape == batch["input_ids"].shape and batch["input_ids"].shape[1] >= original.shape[1]
        for b in range(len(LENGTHS)):  # one label per target, in order (a form may shift where it sits)
            labels = batch["labels"][b]
            assert torch.equal(labels[labels != -100], original[b][target[b]])


@pytest.mark.parametrize("objective,flags", cases())
def test_no_target_sees_itself(objective, flags):
    """The rank rule on the drawn plan: padding is rank 0 and no target; every target has a real token of a lower
    rank to read (its own rank is not below itself, so a target at its row's lowest rank would read only itself)."""
    _, _, plan = collate(objective, flags)
    for b, length in enumerate(LENGTHS):
        ranks, target = plan.group_ids[b], plan.is_target[b]
        assert (ranks[length:] == 0).all() and not target[length:].any()
        lowest = int(ranks[:length].min())
        assert not target[:length][ranks[:length] == lowest].any(), f"row {b}: a target holds the lowest rank"
        assert not target[0], f"row {b}: BOS, the rank-0 condition, is a target"


@pytest.mark.parametrize("objective,flags", two_stream_cases())
def test_the_collated_batch_passes_the_leak_audit(objective, flags, tiny_model):
    collator, batch, plan = collate(objective, flags)
    assert two_stream(collator)
    model = tiny_model(H.LookAroundForPreTraining)
    report = audit_two_stream(model, batch["input_ids"], batch["attention_mask"], batch["group_ids"], plan.is_target)
    assert report.leaks == [] and report.blind == [], (report.leaks[:3], report.blind[:3])
    assert report.targets_checked == int(plan.is_target.sum()) > 0


@pytest.mark.parametrize("objective,flags", cases())
def test_a_seed_gives_one_batch(objective, flags):
    _, first, _ = collate(objective, flags, seed=7)
    _, again, _ = collate(objective, flags, seed=7)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    # the collator hands its seed on to the plan: where the plan function draws something for these rows, another
    # seed gives another batch (AR draws nothing: every seed gives its one plan)
    plan_params = params_of(objective, flags)[1]
    draws = [objectives.make_plan(objective, LENGTHS, max(LENGTHS), torch.Generator().manual_seed(seed),
                                  num_condition_tokens=1, **plan_params).group_ids for seed in range(4)]
    if all(torch.equal(draws[0], d) for d in draws):
        return
    # four rows of dar (t = 2) have 16 plans: one other seed may draw the same, four in a row do not
    others = [collate(objective, flags, seed=seed)[1] for seed in range(8, 12)]
    assert any(not torch.equal(first[k], other[k]) for other in others for k in first), "other seeds drew the same"


@pytest.mark.parametrize("objective,flags", cases())
def test_max_targets_bounds_the_targets(objective, flags):
    plan_params = params_of(objective, flags)[1]
    bound = objectives.max_targets(objective, max(LENGTHS), **plan_params)
    collator, batch, plan = collate(objective, flags, pad_targets_to=bound)
    assert int(plan.is_target.sum(1).max()) <= bound
    if two_stream(collator):
        assert batch["target_positions"].shape == (len(LENGTHS), bound)


def bad_value(field):
    """A value of the flag's type that no objective accepts: what a user could type."""
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    if isinstance(default, bool):
        return None
    if isinstance(default, (int, float)):
        return -1
    if isinstance(default, list):
        return ["nonsense"] if "str" in str(field.type) else [-1]
    return "nonsense"


def flag_cases():
    return [pytest.param(name, f.name, id=f"{name}-{f.name}") for name in objectives.names()
            for f in dataclasses.fields(objectives.get(name).Params) if f.metadata.get("cli", True)]


@pytest.mark.parametrize("objective,flag", flag_cases())
def test_a_bad_flag_gives_one_line_that_names_it(objective, flag):
    field = {f.name: f for f in dataclasses.fields(objectives.get(objective).Params)}[flag]
    value = bad_value(field)
    with pytest.raises(ValueError) as error:
        objectives.get(objective).Params(**{flag: value})
    message = str(error.value)
    assert "\n" not in message and f"--{flag}" in message, message


@pytest.mark.parametrize("objective", objectives.names())
def test_a_parameter_of_another_objective_is_refused_in_one_line(objective):
    """A typo or another objective's parameter does not silently do nothing."""
    own = {f.name for f in dataclasses.fields(objectives.get(objective).collator) if f.init}
    others = sorted({f.name for o in objectives.OBJECTIVES.values() for f in dataclasses.fields(o.collator)
                     if f.init} - own)
    for wrong in ["not_a_parameter", *others]:  # span must refuse mlm's mask_ratio, ar must refuse it too
        with pytest.raises(ValueError, match="takes no parameter") as error:
            objectives.make_collator(objective, ToyTokenizer(VOCAB), **{wrong: 0.2})
        assert "\n" not in str(error.value)
