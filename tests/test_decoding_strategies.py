"""Every decoder plugs into generate() as a DecodingStrategy (issue 38): the bundle's group and speculative
decoding, the package's infilling, and a decoder of your own, one subclass."""

import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundForCausalLM
from hf_lookaround.decoding import DecodingStrategy, GroupDecoding, Infilling, SpeculativeDecoding, \
    UntrainedDecodingError, build_output, infill


def _model(objective, plan_params, seed=0):
    torch.manual_seed(seed)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=40, hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3, objective=objective,
        plan_params=plan_params, prediction_stream="query", initializer_range=0.2)
    return LookAroundForCausalLM(config).eval()


PROMPT = torch.tensor([[1, 7, 9, 11, 13]])


def test_the_shorthands_are_strategies():
    model = _model("dar", {"t": [1, 2]})
    for strategy, shorthand in ((GroupDecoding(2), {"group_size": 2}), (SpeculativeDecoding(2),
                                                                         {"draft_group_size": 2})):
        out = model.generate(PROMPT, decoding=strategy, max_new_tokens=6, eos_token_id=None, do_sample=False)
        assert torch.equal(out, model.generate(PROMPT, max_new_tokens=6, eos_token_id=None, do_sample=False,
                                               **shorthand))
    with pytest.raises(UntrainedDecodingError, match="group_size=3 was not trained"):
        model.generate(PROMPT, decoding=GroupDecoding(3), max_new_tokens=4)
    with pytest.raises(ValueError, match="pass one or the other"):
        model.generate(PROMPT, decoding=GroupDecoding(2), group_size=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="takes a DecodingStrategy"):
        model.generate(PROMPT, decoding="group", max_new_tokens=4)


def test_infilling_through_generate_fills_the_new_positions_as_infill_does():
    model = _model("mlm", {"mask_ratio": 0.15}, seed=1)
    out = model.generate(PROMPT, decoding=Infilling(order="left_to_right"), max_new_tokens=5, eos_token_id=None)
    expected = infill(model, text_or_ids=PROMPT[0], num_tokens=5, order="left_to_right", add_bos=False)
    assert torch.equal(out, expected.sequences)
    # left padding: each row decodes as it would alone
    batch = torch.tensor([[0, 0, 1, 9, 11], [1, 7, 9, 11, 13]])
    out = model.generate(batch, attention_mask=(batch != 0).long(), decoding=Infilling(), max_new_tokens=3,
                         eos_token_id=None)
    alone = model.generate(batch[:1, 2:], decoding=Infilling(), max_new_tokens=3, eos_token_id=None)
    assert torch.equal(out[0, 2:], alone[0]) and torch.equal(out[:, :5], batch)
    with pytest.raises(UntrainedDecodingError, match="group decoding"):
        _model("dar", {"t": 2}).generate(PROMPT, decoding=Infilling(), max_new_tokens=3)


class RepeatLastToken(DecodingStrategy):
    """A decoder of one's own: repeat each prompt's last token."""

    checked = False

    def check(self, config, allow_untrained=False):
        self.checked = True

    def decode(self, model, input_ids, attention_mask, options):
        new = input_ids[:, -1:].expand(-1, options.max_new_tokens)
        return build_output(options, torch.cat([input_ids, new], 1), None)


def test_a_new_decoder_is_one_subclass():
    model, strategy = _model("ar", {}), RepeatLastToken()
    out = model.generate(PROMPT, decoding=strategy, max_new_tokens=3, eos_token_id=None)
    assert strategy.checked and out.tolist() == [[1, 7, 9, 11, 13, 13, 13, 13]]
    with pytest.raises(ValueError, match="left padding"):  # generate() checks the prompt for every decoder
        model.generate(torch.tensor([[1, 7, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), decoding=strategy,
                       max_new_tokens=2)


def test_the_remote_code_bundle_ships_every_decoding_module():
    """The decoders run from a checkpoint loaded with trust_remote_code: every bundle module they import ships."""
    from hf_lookaround.hub.remote_code import _package_module_files

    shipped = {path.name for path in _package_module_files()}
    assert {f"{name}_lookaround.py" for name in ("generation", "decoding", "speculation", "layout", "inputs",
                                                  "masking", "diffusion")} <= shipped
