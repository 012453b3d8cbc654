"""lm-eval's model class ``lookaround`` (``evaluation/lm_eval_model.py``) on tiny random checkpoints, offline.

Requests are lm-eval ``Instance``s built here; ``simple_evaluate`` and ``hf-lookaround lm-eval`` run on local task
YAMLs over JSON Lines the test writes. Checked: equal results at batch 1 and 8, seeded runs repeat, the AR path is
the causal LM's summed log-probs computed directly (and ``is_greedy`` its argmax), the ELBO path agrees with
``perplexity --protocol elbo`` within the stated standard errors, refusals in one line.
"""

import json
import math

import pytest
from conftest import write_lm_eval_tasks
import torch
from lm_eval.api.instance import Instance
from transformers import AutoTokenizer

from hf_lookaround import objectives
from hf_lookaround import LookAroundConfig, LookAroundForCausalLM, LookAroundForMaskedLM, LookAroundForPreTraining
from hf_lookaround.cli import main as cli_main
from hf_lookaround.decoding import DiffusionDecoding
from hf_lookaround.evaluation import lm_eval_model
from hf_lookaround.evaluation.lm_eval_model import LookAroundLM
from hf_lookaround.evaluation.perplexity import elbo_perplexity

POSITIONS = 48
CHOICES = [  # (context, continuation): a context shared by several continuations, and an empty one
    ("The keeper climbed the ladder with a", " hammer"),
    ("The keeper climbed the ladder with a", " bag of nails and bread"),
    ("", "A storm tore two slates from the roof"),
    ("In winter the keeper walked down", " to the village"),
    ("When the fog came in from the sea, the keeper rang the", " bell"),
]
DOCUMENTS = [
    "The lighthouse on the northern cape was built of grey stone in the years before the railway reached the "
    "coast. Its keeper kept a log of every ship that passed, the direction of the wind and the height of the tide.",
    "A storm tore two slates from the roof of the lamp room.",
]
SHORT = "The baker always asked whether the gulls had come back."  # one window: the ELBO of the whole text
def _trained(objective, form=None, **plan_params) -> dict:
    """The config fields pretraining records from the objective's parameters (what the decoders read); ``form``:
    ``--masked_form`` (a flag of the form, not of the plan)."""
    params = objectives.get(objective).Params(**plan_params, **({"masked_form": form} if form else {}))
    return dict(objective=objective, **({"plan_params": plan_params} if plan_params else {}), **params.config_fields())


def _mixture(**components) -> dict:
    """The config fields pretraining records for ``--objective mixture`` with these components, ``{name: (weight,
    the component's flags)}``: its plan parameters (each component's own), its weights and what they record."""
    parts = {name: objectives.get(name).Params(**flags) for name, (_, flags) in components.items()}
    params = objectives.get("mixture").Params(
        mixture=[f"{name}={weight}" for name, (weight, _) in components.items()],
        components={name: p.plan_params() for name, p in parts.items()},
        component_collators={name: p.collator_params() for name, p in parts.items()},
        component_fields={name: p.config_fields() for name, p in parts.items()})
    plan_params = params.plan_params()
    return dict(objective="mixture", plan_params=plan_params, mixture=dict(plan_params["mixture"]),
                default_attention=objectives.default_attention("mixture", plan_params), **params.config_fields())


# mdlm's flags in the mixtures: not its defaults, so that a score drawn with the defaults would differ
MIXED_MDLM = dict(noise_schedule="cosine", diffusion_eps=0.05, low_discrepancy=False)
# kind -> (class, config fields)
KINDS = {
    "ar": (LookAroundForCausalLM, dict(objective="ar", prediction_stream="content", default_attention="causal")),
    "dar": (LookAroundForPreTraining, dict(objective="dar")),
    # SAT's one-stream dar (t = 2): the causal LM lays plain ids out once per first-group size
    "dar-one-stream": (LookAroundForCausalLM, dict(objective="dar", prediction_stream="content",
                                                   default_attention="block_causal", attention_group_size=2)),
    "mdlm": (LookAroundForPreTraining, _trained("mdlm")),
    "bd3lm": (LookAroundForPreTraining, _trained("bd3lm", diffusion_block=4)),
    "mdlm-mask": (LookAroundForMaskedLM, dict(_trained("mdlm"), prediction_stream="content",
                                              architectures=["LookAroundForMaskedLM"])),
    # BD3-LM's one-stream x_t ⊕ x_0 form (--masked_form single_stream): the masked LM in its training layout
    "bd3lm-one-stream": (LookAroundForMaskedLM, dict(
        _trained("bd3lm", "single_stream", diffusion_block=4), prediction_stream="content",
        architectures=["LookAroundForMaskedLM"])),
    "vmlm": (LookAroundForPreTraining, dict(objective="vmlm")),
    # mixtures with a diffusion component: scored by its bound, unless a look-ahead component gives a causal view
    "mdlm+vmlm": (LookAroundForPreTraining, _mixture(mdlm=(0.5, MIXED_MDLM), vmlm=(0.5, {}))),
    "dar+mdlm": (LookAroundForPreTraining, _mixture(dar=(0.5, {}), mdlm=(0.5, MIXED_MDLM))),
}
PATH_OF = {"gpt2": "ar", "ar": "ar", "dar": "ar", "dar-one-stream": "ar", "mdlm": "elbo", "bd3lm": "elbo", "mdlm-mask": "elbo",
           "bd3lm-one-stream": "elbo", "vmlm": "masked", "mdlm+vmlm": "elbo", "dar+mdlm": "ar"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _save(folder, cls, fields, tokenizer):
    """A tiny random checkpoint of ``cls`` with these config fields, and the tokenizer, in ``folder``."""
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=POSITIONS, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        mask_token_id=tokenizer.mask_token_id, **fields)
    cls(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    root = tmp_path_factory.mktemp("lookaround_lm")
    for kind, (cls, fields) in KINDS.items():
        _save(root / kind, cls, fields, tokenizer)
    # a causal LM of another type: the ar path through its own forward and generate()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=POSITIONS, n_embd=32, n_layer=1, n_head=2,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)).save_pretrained(root / "gpt2")
    tokenizer.save_pretrained(root / "gpt2")
    return {kind: root / kind for kind in [*KINDS, "gpt2"]}


@pytest.fixture(scope="module")
def harness(checkpoints):
    """``harness(kind, batch_size, **model_args)``: a LookAroundLM, built once per arguments."""
    made = {}

    def make(kind, batch_size=1, **kw):
        key = (kind, batch_size, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = LookAroundLM(pretrained=str(checkpoints[kind]), batch_size=batch_size, device="cpu",
                                     **{"mc_num": 8, **kw})
        return made[key]

    return make


def _loglikelihood(lm, pairs=CHOICES):
    return lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                            disable_tqdm=True)


def _rolling(lm, texts=DOCUMENTS):
    return lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)],
                                    disable_tqdm=True)


@pytest.mark.parametrize("kind", [*KINDS, "gpt2"])
def test_every_path_gives_the_same_scores_at_batch_1_and_8(kind, harness):
    one, eight = harness(kind, 1, mc_num=4), harness(kind, 8, mc_num=4)
    assert one.path == PATH_OF[kind]
    a, b = _loglikelihood(one), _loglikelihood(eight)
    # ELBO terms carry weights up to 1/eps: float32 noise of a batched forward is scaled by them
    tolerance = dict(rtol=1e-5, atol=1e-3 if one.path == "elbo" else 1e-4)
    torch.testing.assert_close(torch.tensor([x for x, _ in a]), torch.tensor([x for x, _ in b]), **tolerance)
    assert [g for _, g in a] == [g for _, g in b]
    assert all(math.isfinite(x) and x < 0 for x, _ in a)
    rolling = [_rolling(lm) for lm in (one, eight)]
    assert len(rolling[0]) == len(DOCUMENTS) and all(x < 0 for x in rolling[0])
    torch.testing.assert_close(torch.tensor(rolling[0]), torch.tensor(rolling[1]), **tolerance)


def test_seeded_runs_repeat_and_another_seed_draws_other_masks(checkpoints, harness):
    first = _loglikelihood(harness("mdlm", 4, seed=3))
    again = _loglikelihood(LookAroundLM(pretrained=str(checkpoints["mdlm"]), batch_size=4, device="cpu", mc_num=8,
                                        seed=3))
    assert first == again
    other = _loglikelihood(harness("mdlm", 4, seed=4))
    assert all(x != y for (x, _), (y, _) in zip(first, other))
    # the draws of a request are its own: alone or among others, in any order, the same score
    alone = _loglikelihood(harness("mdlm", 4, seed=3), CHOICES[3:4])
    assert alone[0] == first[3]
    assert _loglikelihood(harness("mdlm", 4, seed=3), CHOICES[::-1]) == first[::-1]
    assert _rolling(harness("mdlm", 4, seed=3)) == _rolling(harness("mdlm", 1, seed=3))


@pytest.mark.parametrize("kind", ["ar", "dar", "dar-one-stream", "gpt2"])
def test_the_ar_path_is_the_causal_views_summed_log_probs(kind, checkpoints, harness):
    """log p(continuation | BOS, context) computed directly: the causal LM's logits at k - 1, or the two-stream
    query stream at k under the AR plan (group rank = position); is_greedy: every token is the argmax."""
    lm = harness(kind, 8)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[kind])
    model = type(lm.model).from_pretrained(checkpoints[kind]).eval()

    def direct(ids, first):
        ids = torch.tensor([ids])
        with torch.no_grad():
            if kind != "dar":  # a causal LM: logits[:, i] predict token i + 1
                logp = model(input_ids=ids).logits.log_softmax(-1)[0, first - 1 : -1]
            else:
                targets = torch.arange(first, ids.shape[1])[None]
                logp = model(input_ids=ids, group_ids=torch.arange(ids.shape[1])[None],
                             target_positions=targets).logits.log_softmax(-1)[0]
        gold = ids[0, first:]
        return float(logp.gather(-1, gold[:, None]).sum()), bool((logp.argmax(-1) == gold).all()), logp

    bos = tokenizer.bos_token_id
    for (context, continuation), (score, greedy) in zip(CHOICES, _loglikelihood(lm)):
        ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
        whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        assert whole[: len(ctx)] == ctx
        expected, expected_greedy, _ = direct([bos] + whole, 1 + len(ctx))
        assert score == pytest.approx(expected, rel=1e-5, abs=1e-4)
        assert greedy == expected_greedy
    # a continuation of argmax tokens is greedy
    ids = [bos] + tokenizer("The keeper", add_special_tokens=False)["input_ids"]
    for _ in range(3):
        ids.append(int(direct(ids + [0], len(ids))[2][-1].argmax()))
    context = tokenizer.decode(ids[1:-3])
    continuation = tokenizer.decode(ids[-3:])
    if tokenizer(context + continuation, add_special_tokens=False)["input_ids"] == ids[1:]:  # decodes round-trip
        assert _loglikelihood(lm, [(context, continuation)])[0][1] is True


@pytest.mark.parametrize("kind", ["mdlm", "bd3lm", "mdlm-mask", "bd3lm-one-stream"])
def test_the_elbo_path_agrees_with_perplexity_elbo_within_the_standard_errors(kind, checkpoints, harness):
    """The continuation's negative ELBO given BOS (the whole of a short text, one window) by the class and by
    `perplexity --protocol elbo` on the same text: two independent Monte-Carlo estimates of one number."""
    lm = harness(kind, 16, mc_num=64, seed=1)
    tokenizer = lm.tokenizer
    ids = [tokenizer.bos_token_id] + tokenizer(SHORT, add_special_tokens=False)["input_ids"]
    assert len(ids) <= lm.max_length
    ours, ours_se = lm.elbo_loglikelihood(ids, 1)
    assert -_loglikelihood(lm, [("", SHORT)])[0][0] == pytest.approx(ours, rel=1e-12)  # "" context: BOS only
    reference = elbo_perplexity(lm.model, tokenizer, [SHORT], max_length=lm.max_length, stride=lm.max_length // 2,
                                num_samples=64, seed=2)
    assert reference.num_tokens == len(ids) - 1
    theirs, theirs_se = reference.nlls.sum(), reference.standard_error * reference.num_tokens
    assert 0 < ours_se < ours and 0 < theirs_se
    assert abs(ours - theirs) < 3 * math.hypot(ours_se, theirs_se), (ours, ours_se, theirs, theirs_se)
    # rolling is the command's estimate itself, with the same seed and number of samples
    same = elbo_perplexity(lm.model, tokenizer, [SHORT], max_length=lm.max_length, stride=lm.max_length // 2,
                           num_samples=64, seed=1)
    assert -_rolling(lm, [SHORT])[0] == pytest.approx(same.nlls.sum(), rel=1e-9)


def test_a_mixture_is_scored_by_its_diffusion_components_bound_with_that_components_parameters(harness):
    """mdlm + vmlm: the ELBO of its mdlm component, computed directly with mdlm's elbo_plan, the component's own
    parameters (cosine schedule, eps 0.05, independent times) and the request's seed; mdlm's default parameters give
    another number, so the assertion tells them apart."""
    from hf_lookaround.evaluation import perplexity as ppl
    from hf_lookaround.objectives import mdlm

    lm = harness("mdlm+vmlm", 4, seed=5)
    assert (lm.path, lm.elbo_objective) == ("elbo", "mdlm")
    (context, continuation), tokenizer = CHOICES[3], lm.tokenizer
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    row = [tokenizer.bos_token_id] + tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    first = 1 + len(ctx)

    def direct(**params):
        generator = torch.Generator().manual_seed(lm_eval_model.request_seed(5, row))
        plan = mdlm.elbo_plan(torch.full((lm.mc_num,), len(row)), len(row), num_condition_tokens=first,
                              generator=generator, **params)
        ids = torch.tensor([row] * lm.mc_num)
        with torch.no_grad():
            return -float(ppl.elbo_plan_nlls(lm.model, ids, torch.ones_like(ids), plan, first).mean())

    (score, greedy), = _loglikelihood(lm, [(context, continuation)])
    assert score == pytest.approx(direct(noise_schedule="cosine", eps=0.05, low_discrepancy=False), rel=1e-9)
    assert score != pytest.approx(direct(), rel=1e-3)  # mdlm's defaults: another draw, another number
    assert greedy is False


@pytest.mark.parametrize("kind", ["mdlm+vmlm", "dar+mdlm"])
def test_path_elbo_is_accepted_on_a_mixture_with_a_diffusion_component(kind, harness):
    """Given explicitly, path=elbo scores the diffusion component's bound, also where a look-ahead component makes
    ar the default; it is the same number as the default path of the mixture without one (same weights, seed)."""
    lm = harness(kind, 2, path="elbo", seed=7)
    assert (lm.path, lm.elbo_objective) == ("elbo", "mdlm")
    scores = _loglikelihood(lm, CHOICES[:2])
    assert all(math.isfinite(x) and x < 0 for x, _ in scores)
    assert scores == _loglikelihood(harness("mdlm+vmlm", 2, seed=7), CHOICES[:2])


def test_path_elbo_scores_a_masked_checkpoint_by_mdlms_bound(harness):
    """A masked checkpoint (vmlm) keeps the masked-prefix default; path=elbo scores it by MDLM's bound with mdlm's
    default schedule: the numbers of the mdlm checkpoint (the same weights: same seed and sizes) at the same seed,
    and not the masked-prefix ones."""
    assert harness("vmlm", 2).path == "masked"
    lm = harness("vmlm", 2, path="elbo", seed=7)
    assert (lm.path, lm.elbo_objective) == ("elbo", "mdlm")
    scores = _loglikelihood(lm, CHOICES[:2])
    assert all(math.isfinite(x) and x < 0 for x, _ in scores)
    assert scores == _loglikelihood(harness("mdlm", 2, seed=7), CHOICES[:2])
    assert scores != _loglikelihood(harness("vmlm", 2, seed=7), CHOICES[:2])


def test_a_mixture_of_two_diffusion_objectives_is_refused_in_one_line(tokenizer_dir, tmp_path):
    """mdlm + bd3lm (a hand-written config: pretrain refuses the mixture, whose components record different blocks):
    two bounds, none the checkpoint's, so the elbo path refuses and names the path to take; path=masked scores it."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    plan_params = {"mixture": {"mdlm": 0.5, "bd3lm": 0.5}, "components": {"mdlm": {}, "bd3lm": {"diffusion_block": 4}}}
    _save(tmp_path / "two", LookAroundForPreTraining, dict(objective="mixture", plan_params=plan_params), tokenizer)
    for kwargs in ({}, {"path": "elbo"}):
        with pytest.raises(ValueError, match=r"path=elbo: this mixture has 2 diffusion components \['bd3lm', "
                                             r"'mdlm'\].*use path=masked$") as err:
            LookAroundLM(pretrained=str(tmp_path / "two"), device="cpu", **kwargs)
        assert "\n" not in str(err.value)
    lm = LookAroundLM(pretrained=str(tmp_path / "two"), device="cpu", path="masked")
    assert all(math.isfinite(x) and x < 0 for x, _ in _loglikelihood(lm, CHOICES[:1]))


def test_generate_until_honours_until_and_max_gen_toks(harness, monkeypatch):
    for kind in ("dar", "ar", "gpt2", "mdlm"):
        lm = harness(kind, 2)
        decoded = []  # the new ids of each row, as the class hands them to the tokenizer
        decode = lm.tokenizer.decode
        monkeypatch.setattr(lm.tokenizer, "decode", lambda ids, **kw: decoded.append(list(ids)) or decode(ids, **kw))
        budgets = [5, 3, 5]
        requests = [Instance("generate_until", {}, (c, {"until": ["\n"], "max_gen_toks": n}), i)
                    for i, (c, n) in enumerate(zip(["The keeper", "A storm tore", "In winter"], budgets))]
        out = lm.generate_until(requests, disable_tqdm=True)
        assert len(out) == 3 and all(isinstance(t, str) and "\n" not in t for t in out)
        assert sorted(len(ids) for ids in decoded) <= sorted(budgets) and any(decoded)
        assert all(lm.tokenizer.eos_token_id not in ids for ids in decoded)
        # batch 1 decodes the same
        assert harness(kind, 1).generate_until(requests, disable_tqdm=True) == out
        # a stop string cuts the text before it
        if len(out[0]) > 1:
            stop = out[0][1:]
            again = lm.generate_until([Instance("generate_until", {}, ("The keeper", {"until": [stop],
                                                                                    "max_gen_toks": 5}), 0)],
                                      disable_tqdm=True)
            assert again == [out[0][: out[0].index(stop)]] and len(again[0]) < len(out[0])


GENERATE = [("The keeper", 6), ("A storm tore two slates from the", 6), ("In winter", 6), ("When the fog came", 6)]


def _generate_until(lm, prompts=GENERATE, until=("\n",)):
    return lm.generate_until([Instance("generate_until", {}, (c, {"until": list(until), "max_gen_toks": n}), i)
                              for i, (c, n) in enumerate(prompts)], disable_tqdm=True)


# (kind, knobs, forwards of one batch of GENERATE): a threshold below any random model's confidence commits a whole
# block per forward (bd3lm: 2 blocks of 4 for 6 tokens; mdlm: one block), 2 steps per block take 2 forwards per
# block, and neither knob commits one token per forward
DIFFUSION_KNOBS = [("bd3lm", {"diffusion_threshold": 1e-4}, 2), ("bd3lm", {}, 6), ("mdlm", {"diffusion_steps": 2}, 2),
                   ("mdlm", {"diffusion_threshold": 1e-4}, 1), ("bd3lm-one-stream", {"diffusion_threshold": 1e-4}, 2),
                   ("bd3lm-one-stream", {"diffusion_steps": 2}, 4), ("bd3lm-one-stream", {}, 6)]


@pytest.mark.parametrize("kind, knobs, forwards", DIFFUSION_KNOBS)
def test_generate_until_on_a_diffusion_checkpoint_is_its_generate_with_the_same_knobs(kind, knobs, forwards,
                                                                                       checkpoints, harness):
    """A diffusion checkpoint decodes by diffusion (``DiffusionDecoding``): the texts are those of the checkpoint's
    own ``generate(diffusion_threshold=... | diffusion_steps=...)``, row by row, cut at ``until`` and EOS; a batch of
    4 (left-padded, rows at their own pace) gives what batch 1 gives."""
    lm = harness(kind, 4, **knobs)
    assert lm.decoder == "diffusion"
    calls = []
    hook = lm.model.model.register_forward_hook(lambda *_: calls.append(1))
    out = _generate_until(lm)
    hook.remove()
    assert len(calls) == forwards  # the knobs reach the decoder
    assert _generate_until(harness(kind, 1, **knobs)) == out
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[kind])
    model = LookAroundForCausalLM.from_pretrained(checkpoints[kind]).eval()  # the causal view's generate()
    for (context, n), text in zip(GENERATE, out):
        prompt = [tokenizer.bos_token_id, *tokenizer(context, add_special_tokens=False)["input_ids"]]
        new = model.generate(torch.tensor([prompt]), max_new_tokens=n, pad_token_id=tokenizer.pad_token_id,
                             **(knobs or {"decoding": DiffusionDecoding()}))[0, len(prompt):]
        new = new.tolist()
        new = new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
        expected = tokenizer.decode(new, skip_special_tokens=False).split("\n")[0]
        assert text == expected and len(new) <= n
    assert any(out)


def test_the_diffusion_knobs_are_checked_when_the_model_is_built(checkpoints):
    refusals = [
        (dict(pretrained=str(checkpoints["bd3lm"]), diffusion_threshold=0.9, diffusion_steps=2), "not both"),
        (dict(pretrained=str(checkpoints["bd3lm"]), diffusion_block=8), "block=8 was not trained"),
        (dict(pretrained=str(checkpoints["dar"]), diffusion_threshold=0.9), "drop diffusion_threshold"),
        (dict(pretrained=str(checkpoints["mdlm"]), decoder="sideways"), "choose one of"),
        # BD3-LM's one-stream form reads x_t ⊕ x_0 only: no causal view, no [MASK]-only input
        *[(dict(pretrained=str(checkpoints["bd3lm-one-stream"]), **kw), "path=elbo and decoded by decoder=diffusion")
          for kw in ({"path": "ar"}, {"path": "masked"}, {"decoder": "infill"}, {"decoder": "group"})],
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message) as err:
            LookAroundLM(device="cpu", **kwargs)
        assert "\n" not in str(err.value)
    # the [MASK] form of a diffusion checkpoint, and masked checkpoints without a diffusion plan, infill
    assert LookAroundLM(pretrained=str(checkpoints["mdlm-mask"]), device="cpu").decoder == "infill"
    assert LookAroundLM(pretrained=str(checkpoints["vmlm"]), device="cpu").decoder == "infill"
    assert LookAroundLM(pretrained=str(checkpoints["bd3lm-one-stream"]), device="cpu").decoder == "diffusion"


def test_unsupported_checkpoints_and_arguments_are_refused_in_one_line(checkpoints, tiny_model, tmp_path):
    from hf_lookaround import LookAroundViTForPreTraining

    tiny_model(LookAroundViTForPreTraining).save_pretrained(tmp_path / "vit")
    refusals = [
        (dict(pretrained=str(tmp_path / "vit")), "is a vision checkpoint"),
        (dict(pretrained=str(checkpoints["ar"]), path="elbo"), "path=elbo needs a checkpoint trained with a diffusion"),
        (dict(pretrained=str(checkpoints["vmlm"]), path="sideways"), "choose one of"),
        (dict(pretrained=str(checkpoints["ar"]), temperature_of_sea=3), "do not take"),
        (dict(pretrained=str(checkpoints["mdlm"]), mc_num=1), "mc_num"),
        (dict(pretrained=str(checkpoints["mdlm"]), batch_size="auto"), "no 'auto'"),
        (dict(pretrained=str(checkpoints["ar"]), max_length=POSITIONS + 1), "max_length"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message) as err:
            LookAroundLM(device="cpu", **kwargs)
        assert "\n" not in str(err.value)
    lm = LookAroundLM(pretrained=str(checkpoints["ar"]), device="cpu", max_length=8)
    with pytest.raises(ValueError, match="does not fit the window of 8 tokens"):
        _loglikelihood(lm, [("The", " keeper climbed the ladder with a hammer and nails")])


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A rolling task, a multiple-choice task and a generation task over local JSON Lines (no Hub)."""
    out = tmp_path_factory.mktemp("lookaround_tasks")
    rows = {
        "la_rolling": [{"text": t} for t in DOCUMENTS],
        "la_choice": [{"context": c, "choices": [x, " gulls"], "label": 0} for c, x in CHOICES if c],
        "la_generate": [{"context": c, "answer": x} for c, x in CHOICES if c],
    }
    specs = {
        "la_rolling": dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                           metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]),
        "la_choice": dict(output_type="multiple_choice", doc_to_text="{{context}}", doc_to_choice="{{choices}}",
                          doc_to_target="label", metric_list=[{"metric": "acc"}]),
        "la_generate": dict(output_type="generate_until", doc_to_text="{{context}}", doc_to_target="{{answer}}",
                            generation_kwargs={"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
                            metric_list=[{"metric": "exact_match"}]),
    }
    return write_lm_eval_tasks(out, specs, rows)


@pytest.mark.parametrize("kind", ["dar", "mdlm", "bd3lm-one-stream"])
def test_simple_evaluate_and_the_command_line_run_the_registered_class(kind, checkpoints, task_dir, tmp_path,
                                                                       harness):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    assert get_model("lookaround") is LookAroundLM  # registered by importing the module
    tasks = ["la_rolling", "la_choice", "la_generate"]
    out = simple_evaluate(model="lookaround", model_args=f"pretrained={checkpoints[kind]},mc_num=8,seed=0",
                          tasks=tasks, task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                          device="cpu", batch_size=2, log_samples=True, bootstrap_iters=0)
    assert set(tasks) <= set(out["results"])
    rolling = [s["resps"][0][0] for s in sorted(out["samples"]["la_rolling"], key=lambda s: s["doc_id"])]
    # the harness puts nothing before a rolling document here: the class's own windows (BOS first) score it
    assert rolling == pytest.approx(_rolling(harness(kind, 2, seed=0)), rel=1e-6)
    assert math.isfinite(out["results"]["la_rolling"]["word_perplexity,none"])

    result_dir = tmp_path / "cli"
    code = cli_main(["lm-eval", "--model_args", f"pretrained={checkpoints[kind]},mc_num=8", "--include_path",
                     str(task_dir), "--tasks", "la_rolling,la_choice", "--device", "cpu", "--batch_size", "2",
                     "--output_path", str(result_dir)])
    assert code == 0
    written = json.loads(next(result_dir.rglob("results_*.json")).read_text())
    assert written["results"]["la_rolling"]["word_perplexity,none"] == pytest.approx(
        out["results"]["la_rolling"]["word_perplexity,none"], rel=1e-6)


def test_the_command_line_refuses_a_vision_checkpoint_in_one_line(tiny_model, tmp_path, task_dir, capsys):
    from hf_lookaround import LookAroundViTForPreTraining

    tiny_model(LookAroundViTForPreTraining).save_pretrained(tmp_path / "vit")
    code = cli_main(["lm-eval", "--model_args", f"pretrained={tmp_path / 'vit'}", "--include_path", str(task_dir),
                     "--tasks", "la_choice", "--device", "cpu"])
    assert code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("hf-lookaround lm-eval: error: ") and "is a vision checkpoint" in line


@pytest.fixture
def damaged(checkpoints, tiny_model, tmp_path):
    """A LookAround text checkpoint whose weights file is cut in half, and a vision checkpoint."""
    import shutil

    from hf_lookaround import LookAroundViTForPreTraining

    cut = tmp_path / "cut"
    shutil.copytree(checkpoints["ar"], cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    tiny_model(LookAroundViTForPreTraining).save_pretrained(tmp_path / "vit")
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(checkpoints["ar"], nan)
    weights = load_file(nan / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = torch.full_like(weights[first], float("nan"))
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    return {"cut": (cut, r"truncated or damaged \(model\.safetensors has \d+ bytes, its header says \d+\)"),
            "vision": (tmp_path / "vit", "is a vision checkpoint: lm-eval needs a text checkpoint"),
            "nan": (nan, rf"hold NaN or infinite values in 1 tensor\(s\) \({first}\)")}


@pytest.mark.parametrize("model", ["lookaround", "hf"])
@pytest.mark.parametrize("damage", ["cut", "vision", "nan"])
def test_the_command_line_checks_the_checkpoint_before_lm_eval_prints_anything(damaged, task_dir, capsys, damage,
                                                                               model):
    """Issue 43: exactly one line and exit status 2, for lm-eval's `hf` model too (lm-eval would print its own
    traceback for a cut file, fail in the tokenizer of a vision checkpoint, and print its set-up before NaN weights
    are refused)."""
    import re

    folder, message = damaged[damage]
    code = cli_main(["lm-eval", "--model", model, "--model_args", f"pretrained={folder},trust_remote_code=True",
                     "--include_path", str(task_dir), "--tasks", "la_choice", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"hf-lookaround lm-eval: error: ") and str(folder) in err[0]
    assert re.search(message, err[0]), err[0]


@pytest.mark.parametrize("damage", ["cut", "vision"])
def test_simple_evaluate_refuses_in_the_classes_init_before_a_tokenizer_or_config_loads(damaged, task_dir, damage,
                                                                                        monkeypatch):
    import transformers
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    def never(*args, **kwargs):
        raise AssertionError("read before the checkpoint was checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", never)
    folder, message = damaged[damage]
    with pytest.raises(ValueError, match=message) as err:
        simple_evaluate(model="lookaround", model_args=f"pretrained={folder}", tasks=["la_choice"],
                        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), device="cpu")
    assert "\n" not in str(err.value)
    assert "LookAroundLM.__init__" in "".join(f"{t.tb_frame.f_code.co_qualname}" for t in _frames(err.tb))


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_the_pretrained_argument_is_read_in_every_spelling_lm_eval_takes():
    from hf_lookaround.cli.lm_evaluation import pretrained_argument

    assert pretrained_argument(["--model_args", "pretrained=a,mc_num=8", "--tasks", "x"]) == "a"
    assert pretrained_argument(["-a", "mc_num=8", "pretrained=b", "--tasks", "x"]) == "b"
    assert pretrained_argument(["--model_args=pretrained=c,seed=1"]) == "c"
    assert pretrained_argument(["--tasks", "pretrained=d"]) is None


def test_harness_arguments_default_to_the_lookaround_model():
    assert lm_eval_model.cut_at_stops("a. b\nc", [".", "\n"]) == "a"
    from hf_lookaround.cli.lm_evaluation import harness_argv

    assert harness_argv(["--tasks", "x"]) == ["--model", "lookaround", "--tasks", "x"]
    assert harness_argv(["run", "--tasks", "x"]) == ["run", "--model", "lookaround", "--tasks", "x"]
    assert harness_argv(["--model", "hf", "--tasks", "x"]) == ["--model", "hf", "--tasks", "x"]
    assert harness_argv(["ls", "tasks"]) == ["ls", "tasks"]
