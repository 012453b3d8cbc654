"""generate() features with group decoding (group_size=t) and self-speculative decoding (draft_group_size=k):
streamers, stop strings, stopping criteria, return_dict_in_generate and scores, each against transformers' own
token-by-token loop where the tokens must agree."""

import io
import logging
from contextlib import redirect_stdout

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.streamers import BaseStreamer

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM
from hf_lookaround.data.tokenization import train_tokenizer

CORPUS = [
    "The committee met on Tuesday and agreed that the budget would be revised before spring.",
    "the of and to in a is that for it as was with be by on not he",
]
# (generate kwargs, what they give): t = 1 through the hook, group decoding, self-speculative decoding
DECODERS = [{"group_size": 1}, {"group_size": 2}, {"draft_group_size": 2}, {"draft_group_size": 3}]
EXACT = [d for d in DECODERS if d.get("group_size", 1) == 1]  # the tokens of token-by-token decoding


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer(CORPUS * 5, vocab_size=300, min_frequency=1)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id, objective="dar",
        plan_params={"t": [1, 2, 3]}, prediction_stream="query", initializer_range=0.2,
    )
    return LookAroundForCausalLM(config).eval()


def _prompt(tokenizer, text="The committee met on"):
    return torch.tensor([[tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]])


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("decoder", DECODERS, ids=str)
def test_streamers_get_every_token_and_end(model, tokenizer, decoder):
    prompt = _prompt(tokenizer)
    recorder = Recorder()
    out = model.generate(prompt, max_new_tokens=9, eos_token_id=None, streamer=recorder, **decoder)
    # the prompt first (as transformers' loop does), then the new tokens (a group or the accepted drafts at once)
    assert recorder.puts[0] == prompt.tolist() and recorder.ended == 1
    streamed = [tok for put in recorder.puts[1:] for tok in (put[0] if isinstance(put[0], list) else put)]
    assert streamed == out[0, prompt.shape[1]:].tolist()
    printed = io.StringIO()
    with redirect_stdout(printed):
        model.generate(prompt, max_new_tokens=9, eos_token_id=None, streamer=TextStreamer(tokenizer, skip_prompt=True),
                       **decoder)
    assert printed.getvalue() == tokenizer.decode(out[0, prompt.shape[1]:]) + "\n"


def test_streamer_with_a_batch_is_refused(model, tokenizer):
    prompt = _prompt(tokenizer).repeat(2, 1)
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(prompt, max_new_tokens=4, streamer=Recorder(), draft_group_size=2)


@pytest.mark.parametrize("decoder", DECODERS, ids=str)
def test_stop_strings_with_the_tokenizer(model, tokenizer, decoder):
    prompt = _prompt(tokenizer)
    free = model.generate(prompt, max_new_tokens=20, eos_token_id=None, **decoder)[0, prompt.shape[1]:]
    # a word the continuation reaches midway (a random model also emits pieces of UTF-8 characters)
    stop = next(piece for i in range(2, len(free)) if (piece := tokenizer.decode(free[i:i + 1]).strip()).isalpha()
                and piece not in tokenizer.decode(free[:i]))
    out = model.generate(prompt, max_new_tokens=20, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer,
                         pad_token_id=tokenizer.pad_token_id, **decoder)
    new = out[0, prompt.shape[1]:]
    new = new[new != tokenizer.pad_token_id]  # a group decoder pads the rest of the group that held the stop
    assert stop in tokenizer.decode(new) and stop not in tokenizer.decode(new[:-1]) and len(new) < 20
    if decoder in EXACT:
        plain = model.generate(prompt, max_new_tokens=20, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
        assert torch.equal(out, plain)
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(prompt, max_new_tokens=4, stop_strings=[stop], **decoder)


class StopAfter(StoppingCriteria):
    """Stops a row once it holds `token` among its last 3 tokens (reads the sequence, as stop criteria do)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -3:] == self.token).any(-1)


@pytest.mark.parametrize("decoder", EXACT, ids=str)
def test_stopping_criteria_scores_and_return_dict_match_token_by_token(model, tokenizer, decoder):
    prompts = tokenizer(["<s>The committee met on", "<s>agreed that the"], add_special_tokens=False,
                        return_tensors="pt", padding=True)
    free = model.generate(**prompts, max_new_tokens=10, eos_token_id=None)
    token = free[0, -5].item()  # row 0 reaches it midway
    # with an EOS criterion transformers pads a row that stopped (without one it goes on writing tokens)
    kwargs = dict(max_new_tokens=10, eos_token_id=tokenizer.eos_token_id, stopping_criteria=StoppingCriteriaList([StopAfter(token)]),
                  return_dict_in_generate=True, output_scores=True, output_logits=True,
                  pad_token_id=tokenizer.pad_token_id)
    plain = model.generate(**prompts, **kwargs)
    out = model.generate(**prompts, **kwargs, **decoder)
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == len(out.logits)
    finished_at = (plain.sequences[0, prompts["input_ids"].shape[1]:] == token).nonzero()[0].item()
    for i, (got, want) in enumerate(zip(out.logits, plain.logits)):
        rows = [0, 1] if i <= finished_at else [1]  # after a row stops, transformers keeps scoring its padding
        torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=0)
    if "draft_group_size" in decoder:
        assert 0 <= out.acceptance_rate <= 1 and out.num_drafted.shape == (2,)


class Never(StoppingCriteria):
    """A criterion that never stops a row: it makes group decoding write a group token by token."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("group_size", [2, 3])
def test_a_group_written_at_once_equals_the_token_by_token_writes(model, tokenizer, group_size, do_sample):
    """With EOS as the only criterion a group's tokens are written in one step; a criterion of the user's makes them
    written (and asked) token by token. Both give the same sequences and scores, a row ending inside a group."""
    from hf_lookaround.decoding import group_generate

    prompts = tokenizer(["<s>The committee met on", "<s>agreed that the"], add_special_tokens=False,
                        return_tensors="pt", padding=True)
    start = prompts["input_ids"].shape[1]

    def decode(**kwargs):
        return group_generate(model, prompts["input_ids"], prompts["attention_mask"], group_size=group_size,
                              max_new_tokens=12, do_sample=do_sample, generator=torch.Generator().manual_seed(0),
                              pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, output_scores=True,
                              **kwargs)

    free = decode(eos_token_id=[]).sequences[0, start:].tolist()
    # an EOS that row 0 first reaches before the last slot of a group (the groups start at the first new token):
    # the slots after it in the same group were drawn in the same step and must be written as padding
    end = next(i for i in range(len(free) - 1) if (i + 1) % group_size and free[i] not in free[:i])
    at_once = decode(eos_token_id=free[end])
    by_token = decode(eos_token_id=free[end], stopping_criteria=StoppingCriteriaList([Never()]))
    assert torch.equal(at_once.sequences, by_token.sequences)
    assert len(at_once.scores) == len(by_token.scores)
    assert all(torch.equal(a, b) for a, b in zip(at_once.scores, by_token.scores))
    row = at_once.sequences[0, start:].tolist()
    assert row[: end + 1] == free[: end + 1] and set(row[end + 1 :]) <= {tokenizer.pad_token_id}


def test_group_decoding_scores_have_one_entry_per_token(model, tokenizer):
    prompt = _prompt(tokenizer)
    out = model.generate(prompt, group_size=3, max_new_tokens=7, eos_token_id=None, return_dict_in_generate=True,
                         output_scores=True, output_logits=True)
    assert out.sequences.shape[1] == prompt.shape[1] + 7 and len(out.scores) == len(out.logits) == 7
    assert all(s.shape == (1, len(tokenizer)) for s in out.scores)
    picked = torch.stack([s.argmax(-1) for s in out.scores], 1)
    assert torch.equal(picked, out.sequences[:, prompt.shape[1]:])


def test_default_group_size_is_the_trained_one(tokenizer, caplog):
    """A checkpoint that never trained t = 1 decodes with its own group size when none is asked for."""
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, objective="dar", plan_params={"t": 2}, prediction_stream="query",
        initializer_range=0.2,
    )
    model = LookAroundForCausalLM(config).eval()
    prompt = _prompt(tokenizer)
    with caplog.at_level(logging.INFO, logger="hf_lookaround.models.lookaround.generation_lookaround"):
        default = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    assert "group_size=2" in caplog.text
    assert torch.equal(default, model.generate(prompt, group_size=2, max_new_tokens=6, eos_token_id=None))
    assert not torch.equal(default, model.generate(prompt, group_size=1, allow_untrained=True, max_new_tokens=6,
                                                   eos_token_id=None))


# ----------------------------------------------------------------------------------------------
# infilling builds the plan pretraining trained
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["mlm", "vmlm", "gvp"])
def test_infilling_first_step_is_the_pretraining_forward(tokenizer, objective):
    """The collator's plan on a BOS-prefixed block (BOS rank 0, visible rank 1, the first hidden group rank 2):
    infilling the same hidden set gives, at its first step, the query logits of the pretraining forward."""
    from hf_lookaround import LookAroundForPreTraining
    from hf_lookaround.objectives import make_collator
    from hf_lookaround.decoding.infill import infill

    params = {"mlm": {"mask_ratio": 0.3}, "vmlm": {}, "gvp": {"num_groups": 3}}[objective]
    torch.manual_seed(1)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id, objective=objective,
        plan_params=params, initializer_range=0.2,
    )
    model = LookAroundForPreTraining(config).eval()
    block = [tokenizer.bos_token_id] + tokenizer(CORPUS[0], add_special_tokens=False)["input_ids"][:20]
    batch = make_collator(objective, tokenizer, seed=3, **params)([{"input_ids": block}])
    ranks = batch["group_ids"][0]
    assert ranks[0] == 0 and (ranks[1:] >= 1).all()  # BOS is the condition token, alone at rank 0
    visible = ranks <= 1
    first_hidden = ranks == 2  # the group the first step predicts from BOS and the visible tokens
    assert first_hidden.any() and visible[1:].any()
    targets = first_hidden.nonzero().flatten()[None]
    expected = model(input_ids=batch["input_ids"], group_ids=batch["group_ids"], target_positions=targets).logits[0]
    out = infill(model, tokenizer, batch["input_ids"][0], hidden=~visible, steps=1, output_logits=True)
    torch.testing.assert_close(out.logits[0][0, targets[0]], expected, atol=1e-5, rtol=1e-5)
    # the fill-mask head (AutoModelForMaskedLM of a two-stream checkpoint) ranks [MASK] inputs the same way
    from hf_lookaround import LookAroundForMaskedLM

    masked_lm = LookAroundForMaskedLM(model.config).eval()
    masked_lm.load_state_dict(model.state_dict())
    masked = torch.where(visible, batch["input_ids"][0], tokenizer.mask_token_id)[None]
    torch.testing.assert_close(masked_lm(input_ids=masked).logits[0, targets[0]], expected, atol=1e-5, rtol=1e-5)


def test_infill_text_is_a_string_for_a_string(tokenizer):
    from hf_lookaround import LookAroundForPreTraining
    from hf_lookaround.decoding.infill import infill

    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id, objective="mlm",
        plan_params={"mask_ratio": 0.15},
    )
    model = LookAroundForPreTraining(config).eval()
    one = infill(model, tokenizer, "The committee[MASK] on[MASK]")
    assert isinstance(one.text, str) and one.text.startswith("The committee")
    two = infill(model, tokenizer, ["The[MASK] met", "agreed[MASK]"])
    assert isinstance(two.text, list) and len(two.text) == 2


@pytest.mark.parametrize("objective", ["mlm", "gvp"])
def test_infill_never_commits_the_mask_token(tokenizer, objective):
    """A barely trained checkpoint may rate [MASK] highest at a hidden position; infilling must not commit it
    (issue 43: skip_special_tokens then dropped it from the text without a word)."""
    from hf_lookaround import LookAroundForPreTraining
    from hf_lookaround.decoding.infill import infill

    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id, objective=objective,
    )
    model = LookAroundForPreTraining(config).eval()

    class FavourTheMask(torch.nn.Module):  # the head rates [MASK] first at every position
        def __init__(self, head):
            super().__init__()
            self.head = head

        def forward(self, hidden):
            logits = self.head(hidden)
            logits[..., tokenizer.mask_token_id] += 100.0
            return logits

    model.lm_head = FavourTheMask(model.lm_head)
    out = infill(model, tokenizer, ["The committee[MASK][MASK] on[MASK]", "agreed[MASK]"], output_logits=True)
    assert tokenizer.mask_token_id not in out.sequences.tolist()[0] + out.sequences.tolist()[1]
    # the first step's logits rated the mask token first at every hidden position: the rule is what kept it out
    first = out.logits[0]
    hidden = ~first[..., 0].isnan()
    assert hidden.any() and (first.argmax(-1)[hidden] == tokenizer.mask_token_id).all()


# ----------------------------------------------------------------------------------------------
# prompts end without EOS
# ----------------------------------------------------------------------------------------------
def _old_tokenizer(tokenizer, tmp_path):
    """A tokenizer saved before prompts lost their EOS: its template wraps a single text as <s> ... </s>."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    old = AutoTokenizer.from_pretrained(_saved(tokenizer, tmp_path / "new"))
    bos, eos = old.bos_token_id, old.eos_token_id
    old.backend_tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
                                      special_tokens=[("<s>", bos), ("</s>", eos)]),
    ])
    return AutoTokenizer.from_pretrained(_saved(old, tmp_path / "old"))  # it still loads


def _saved(tokenizer, path):
    tokenizer.save_pretrained(path)
    return path


def test_prompts_end_without_eos_and_old_tokenizers_are_warned_about(model, tokenizer, tmp_path, caplog):
    from transformers import pipeline

    ids = tokenizer("The committee met on")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id
    assert tokenizer("a", "b")["input_ids"].count(tokenizer.eos_token_id) == 2  # pairs keep their separators
    old = _old_tokenizer(tokenizer, tmp_path)
    assert old("The committee met on")["input_ids"] == ids + [tokenizer.eos_token_id]
    logger = "hf_lookaround.models.lookaround.generation_lookaround"
    for kwargs in ({}, {"group_size": 2}, {"draft_group_size": 2}):  # token by token, groups, drafts
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=logger):
            model.generate(**old("The committee met on", return_tensors="pt"), max_new_tokens=2, **kwargs)
        assert "ends with the EOS token" in caplog.text, kwargs
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=logger):
            model.generate(**tokenizer("The committee met on", return_tensors="pt"), max_new_tokens=2, **kwargs)
        assert "ends with the EOS token" not in caplog.text, kwargs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=logger):
        pipeline("text-generation", model=model, tokenizer=old)("The committee met on", max_new_tokens=2)
    assert "ends with the EOS token" in caplog.text


def test_classification_inputs_keep_their_end_token(tokenizer, tmp_path):
    """Fine-tuning and probing encode a single sentence as <s> A </s>, as before and as pairs; truncation keeps
    the end token; an older tokenizer (which adds it itself) gets no second one."""
    from hf_lookaround.data.tokenization import encode_sentences

    eos = tokenizer.eos_token_id
    texts = ["The committee met on Tuesday", "agreed"]
    enc = encode_sentences(tokenizer, texts)
    plain = tokenizer(texts)["input_ids"]
    assert enc["input_ids"] == [ids + [eos] for ids in plain]
    assert enc["attention_mask"] == [[1] * len(ids) for ids in enc["input_ids"]]
    short = encode_sentences(tokenizer, texts, truncation=True, max_length=4)["input_ids"]
    assert all(len(ids) > 4 for ids in enc["input_ids"]) and short == [ids[:3] + [eos] for ids in plain]
    padded = encode_sentences(tokenizer, texts, padding=True, return_tensors="pt")
    assert padded["input_ids"].shape == (2, len(enc["input_ids"][0])) and padded["attention_mask"][1].sum() == \
        len(enc["input_ids"][1])
    pairs = encode_sentences(tokenizer, texts, ["b", "c"])["input_ids"]
    assert pairs == tokenizer(texts, ["b", "c"])["input_ids"]
    old = _old_tokenizer(tokenizer, tmp_path)
    assert encode_sentences(old, texts)["input_ids"] == enc["input_ids"]


def test_cli_decodes_a_dar_checkpoint_with_its_own_group_size(tokenizer, tmp_path, capsys):
    """`hf-lookaround generate` without --group_size used to ask for t = 1 and so refused a dar t = 2 checkpoint."""
    import json

    from hf_lookaround import LookAroundForPreTraining
    from hf_lookaround.cli.generate import main
    from hf_lookaround.decoding import group_generate

    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, objective="dar", plan_params={"t": 2}, initializer_range=0.2,
    )
    model = LookAroundForPreTraining(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main([str(tmp_path), "--prompt", "The committee", "--max_new_tokens", "6", "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    prompt = _prompt(tokenizer, "The committee")
    expected = group_generate(model, prompt, group_size=2, max_new_tokens=6)[0, prompt.shape[1]:]
    assert result["group_size"] == 2 and result["outputs"] == [tokenizer.decode(expected, skip_special_tokens=True)]


# ----------------------------------------------------------------------------------------------
# compiled decoding: a static cache and fixed shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decoder", [{"group_size": 2}, {"group_size": 3}, {"draft_group_size": 2},
                                     {"draft_group_size": 3}], ids=str)
def test_static_cache_compiles_once_and_gives_the_same_tokens(model, tokenizer, decoder):
    """cache_implementation='static' gives the tokens of the DynamicCache decoder; compiled (backend 'eager' on the
    CPU, fullgraph), one graph serves every step after the prompt's, and a second call with the same shapes
    compiles nothing: error_on_recompile holds."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    torch._dynamo.reset()
    prompts = tokenizer(["<s>The committee met on", "<s>agreed that"], add_special_tokens=False, return_tensors="pt",
                        padding=True)
    kwargs = dict(max_new_tokens=11, eos_token_id=None, pad_token_id=tokenizer.pad_token_id, **decoder)
    dynamic = model.generate(**prompts, **kwargs)
    assert torch.equal(model.generate(**prompts, cache_implementation="static", **kwargs), dynamic)  # eager on CPU
    compiled = dict(cache_implementation="static", compile_config=CompileConfig(backend="eager", fullgraph=True))
    before = counters["stats"]["unique_graphs"]  # counters are global: count what this call compiles
    assert torch.equal(model.generate(**prompts, **compiled, **kwargs), dynamic)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - before == 1  # the steady step; the prompt's forward runs eager (it owns the cache's tensors)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = model.generate(**prompts, **compiled, **kwargs)
    assert torch.equal(again, dynamic) and counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("decoder", [{"group_size": 2}, {"draft_group_size": 2}], ids=str)
def test_pipeline_takes_stop_strings_with_a_tokenizer(model, tokenizer, decoder):
    """As with transformers' own decoding, the pipeline call names the tokenizer for stop strings."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, return_full_text=False, **decoder)
    full = pipe("The committee met on", **kwargs)
    assert pipe("The committee met on", stop_strings=["never in the text"], tokenizer=tokenizer, **kwargs) == full
    with pytest.raises(ValueError, match="tokenizer="):
        pipe("The committee met on", stop_strings=["never in the text"], **kwargs)


@pytest.mark.parametrize("decoder", [{"group_size": 2}, {"draft_group_size": 2}], ids=str)
def test_features_these_decoders_lack_are_refused(model, tokenizer, decoder):
    prompt = _prompt(tokenizer)
    for kwargs, match in (({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
                          ({"output_hidden_states": True, "return_dict_in_generate": True}, "output_hidden_states"),
                          ({"guidance_scale": 1.5}, "guidance_scale"),
                          ({"num_beams": 2}, "beam")):
        with pytest.raises(ValueError, match=match):
            model.generate(prompt, max_new_tokens=4, **kwargs, **decoder)


@pytest.mark.parametrize("decoder", [{"group_size": 2}, {"draft_group_size": 2}], ids=str)
def test_generate_samples_with_the_generator_it_is_given(model, tokenizer, decoder):
    """generate(..., generator=g) reaches group and self-speculative decoding (the CLI's seeded draws go through
    generate()): the draws are group_generate()'s with the same generator, whatever torch's global seed."""
    from hf_lookaround.decoding import group_generate

    prompt = _prompt(tokenizer)
    kwargs = dict(max_new_tokens=8, do_sample=True, top_k=0, eos_token_id=[])
    torch.manual_seed(123)
    got = model.generate(prompt, generator=torch.Generator().manual_seed(5), pad_token_id=tokenizer.pad_token_id,
                         **decoder, **kwargs)
    expected = group_generate(model, prompt, generator=torch.Generator().manual_seed(5), **decoder, **kwargs)
    assert torch.equal(got, expected)
