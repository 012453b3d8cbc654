"""What a checkpoint can decode comes from its objective's ``Params`` (``config_fields()``), not from a table in the
model bundle (issue 38): a new look-ahead objective is one module, and its checkpoints group-decode."""

import sys
import textwrap

import pytest
import torch

from hf_lookaround import LookAroundForCausalLM, objectives
from hf_lookaround.decoding import UntrainedDecodingError, group_generate
from hf_lookaround.models.lookaround import configuration_lookaround
from hf_lookaround.training.pretraining import ModelArguments, ObjectiveArguments, build_collators, build_config, \
    build_model

TOY = "toy_groups_of_three"
# one objective module, as a contributor would add it to objectives/: a look-ahead plan of fixed groups of three
TOY_MODULE = textwrap.dedent(f'''
    """``{TOY}``: groups of three tokens after the condition prefix, each predicted from the earlier groups."""

    from dataclasses import dataclass

    import numpy as np
    import torch

    from ..data.collators import PlanCollator
    from ..plans import Plan, check_lengths, inside_positions
    from .base import LOOK_AHEAD, Objective, ObjectiveParams


    def plan(lengths, seq_len: int, num_condition_tokens: int = 0, generator=None) -> Plan:
        lengths = check_lengths(lengths, seq_len, num_condition_tokens)
        c = num_condition_tokens
        inside = inside_positions(lengths, seq_len, c)
        ranks = np.where(np.arange(seq_len) < c, 0, (np.arange(seq_len) - c) // 3 + (1 if c else 0))
        return Plan(torch.from_numpy(np.where(inside, ranks, 0)), torch.from_numpy(inside & (ranks >= 1)))


    @dataclass
    class Params(ObjectiveParams):
        @classmethod
        def decoding_group_sizes(cls, plan_params: dict) -> tuple:
            return (3,)


    @dataclass
    class Collator(PlanCollator):
        objective = "{TOY}"
        plan_function = staticmethod(plan)


    OBJECTIVE = Objective(name="{TOY}", family=LOOK_AHEAD, title="groups of three", card_text="groups of three",
                          Params=Params, plan=plan, collator=Collator)
''')


@pytest.fixture
def toy_objective(tmp_path, monkeypatch):
    """The toy module registered the way objectives register: a module of the objectives package, found by the
    table's discovery."""
    (tmp_path / f"{TOY}.py").write_text(TOY_MODULE)
    monkeypatch.setattr(objectives, "__path__", [*objectives.__path__, str(tmp_path)])
    table = objectives._discover()
    monkeypatch.setattr(objectives, "OBJECTIVES", table)
    monkeypatch.setattr(objectives, "PLAN_NAMES", tuple(table))
    yield table[TOY]
    sys.modules.pop(f"{objectives.__name__}.{TOY}", None)


def test_a_look_ahead_objective_in_one_module_group_decodes_with_its_own_group_size(toy_objective, tokenizer):
    bundle = configuration_lookaround.__file__.rsplit("/", 1)[0]
    assert all(TOY not in open(f"{bundle}/{name}_lookaround.py").read() for name in ("decoding", "generation"))
    args = ObjectiveArguments(objective=TOY)
    model_args = ModelArguments(preset="tiny", config_overrides="hidden_size=32,intermediate_size=64,"
                                                                "max_position_embeddings=64")
    config = build_config(model_args, args, tokenizer, block_size=16)
    assert config.decoding_group_sizes == [3]
    torch.manual_seed(0)
    model = build_model(config, model_args, args)
    # one training step on the toy plan: the objective trains like any other
    collator, _ = build_collators(args, tokenizer, seed=0, block_size=16, static_shapes=False)
    ids = tokenizer("The committee met on Tuesday and agreed on the budget.")["input_ids"][:16]
    batch = collator([{"input_ids": ids}, {"input_ids": ids[:12]}])
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.lm_head.weight.grad.abs().sum() > 0
    causal = LookAroundForCausalLM(model.config).eval()  # the head of generate(): the same weights
    causal.load_state_dict(model.state_dict())

    prompt = torch.tensor([ids[:5]])
    out = causal.generate(prompt, group_size=3, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out.shape == (1, 11) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, group_generate(model.eval(), prompt, group_size=3, max_new_tokens=6, eos_token_id=[]))
    with pytest.raises(UntrainedDecodingError, match=r"group_size=2 was not trained.*\[3\]"):
        causal.generate(prompt, group_size=2, max_new_tokens=4)


def test_every_objective_records_what_it_decodes_from_its_params():
    """A look-ahead objective records its plan's group sizes; the others record none (they infill)."""
    for name, objective in objectives.OBJECTIVES.items():
        if objective.family == objectives.MIXTURE:
            continue
        recorded = objective.Params().config_fields()["decoding_group_sizes"]
        if objective.family == objectives.LOOK_AHEAD:
            assert recorded == [objective.defaults.get("t", 1)], name
        else:
            assert recorded == [], name
    mixture = objectives.get("mixture").Params
    params = {"mixture": {"dar": 0.5, "ar": 0.25, "vmlm": 0.25}, "components": {"dar": {"t": [2, 3]}}}
    assert mixture.decoding_group_sizes(params) == (1, 2, 3)
    params["mixture"]["ar"] = 0.0  # a component of weight 0 was never trained
    assert mixture.decoding_group_sizes(params) == (2, 3)
