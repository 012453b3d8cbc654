"""`hf-lookaround pretrain --init_from` (issue 39): a few steps of dar's one-stream form, vmlm and the one-stream
mixture from a saved tiny Llama and a saved tiny Qwen2 (converted on the fly), full or with LoRA; the result loads
through the Auto classes, decodes groups of 2 and infills."""

import gzip
import json

import pytest
import torch
from conftest import one_line_error
from test_adaptation import save_source, source_texts

from hf_lookaround.cli import main as cli_main

SOURCES = {"llama": "llama_gqa_untied_linear", "qwen2": "qwen2_qkv_bias_tied"}
OBJECTIVES = {
    "dar_one_stream": ["--objective", "dar", "--group_size", "2", "--dar_form", "single_stream"],
    "vmlm": ["--objective", "vmlm"],
    "mixture_one_stream": ["--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5", "--group_size", "2",
                           "--dar_form", "single_stream", "--masked_form", "single_stream"],
    # the other forms (test_other_forms_...)
    "dar_two_stream": ["--objective", "dar", "--group_size", "2"],
    "vmlm_one_stream": ["--objective", "vmlm", "--masked_form", "single_stream"],
    "ar_one_stream": ["--objective", "ar", "--ar_form", "single_stream"],
    "bd3lm_one_stream": ["--objective", "bd3lm", "--diffusion_block", "4", "--masked_form", "single_stream"],
}
ISSUE_OBJECTIVES = ("dar_one_stream", "vmlm", "mixture_one_stream")  # the issue's: from a Llama and a Qwen2


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    for family, name in SOURCES.items():
        save_source(root / family, name)
    with gzip.open(root / "train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in source_texts(count=24, seed=1))
    return root


def pretrain(sources, out, family, objective, *extra):
    return cli_main([
        "pretrain", "--init_from", str(sources / family), "--train_files", str(sources / "train.jsonl.gz"),
        "--block_size", "16", *OBJECTIVES[objective], "--per_device_train_batch_size", "4", "--max_train_samples", "8",
        "--max_steps", "2", "--learning_rate", "1e-3", "--do_train", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--save_strategy", "no", "--output_dir", str(out), *extra,
    ])


def changed(out) -> bool:
    """Whether training moved the converted weights (the output against the conversion in out/init_from)."""
    from safetensors.torch import load_file

    before, after = load_file(out / "init_from" / "model.safetensors"), load_file(out / "model.safetensors")
    return any(not torch.equal(before[k], after[k]) for k in before if k in after)


def check_decodes_and_infills(out, objective):
    from transformers import AutoModelForCausalLM, AutoModelForPreTraining, AutoTokenizer

    from hf_lookaround.decoding.infill import infill

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.mask_token == "<|mask|>"
    ids = tok(tok.bos_token + " w1 w2 w3", return_tensors="pt", add_special_tokens=False).input_ids
    if objective != "vmlm":  # dar's one-stream rows, alone or in the mixture: t = 2 tokens per forward
        causal = AutoModelForCausalLM.from_pretrained(out).eval()
        assert causal.config.attention_group_size == 2
        generated = causal.generate(ids, max_new_tokens=4, do_sample=False, group_size=2)
        assert generated.shape == (1, ids.shape[1] + 4)
    if objective != "dar_one_stream":  # the masked rows: any-order infilling
        result = infill(AutoModelForPreTraining.from_pretrained(out).eval(), tok,
                        ["w1 w2<|mask|><|mask|> w5 w6"], steps=2, order="confidence")
        assert tok.mask_token not in result.text[0] and result.text[0].startswith("w1 w2")


@pytest.mark.parametrize("family", list(SOURCES))
@pytest.mark.parametrize("objective", ISSUE_OBJECTIVES)
def test_pretrain_init_from_a_causal_lm(sources, tmp_path, family, objective):
    out = tmp_path / "run"
    assert pretrain(sources, out, family, objective) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["source_model_type"] == family and config["objective"] == objective.split("_")[0]
    assert (out / "init_from" / "config.json").is_file() and changed(out)
    check_decodes_and_infills(out, objective)


@pytest.mark.parametrize("family", list(SOURCES))
def test_bd3lm_one_stream_starts_from_a_causal_lm_and_decodes_blocks(sources, tmp_path, family):
    """BD3-LM's x_t ⊕ x_0 form (issue 40) adapts a causal LM: the masked LM trains, the causal class decodes blocks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "bd3lm"
    assert pretrain(sources, out, family, "bd3lm_one_stream") == 0 and changed(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["source_model_type"], config["default_attention"], config["attention_group_size"]) == \
        (family, "block_diffusion", 4)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(tok.bos_token + " w1 w2 w3", return_tensors="pt", add_special_tokens=False).input_ids
    generated = AutoModelForCausalLM.from_pretrained(out).eval().generate(
        ids, max_new_tokens=8, do_sample=False, diffusion_threshold=0.9, eos_token_id=None)
    assert generated.shape == (1, ids.shape[1] + 8) and not (generated == tok.mask_token_id).any()


def test_pretrain_with_lora_saves_a_merged_checkpoint(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    assert pretrain(sources, out, "qwen2", "dar_one_stream", "--lora_r", "4", "--learning_rate", "5e-2") == 0
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert not any("lora_" in k or "base_layer" in k for k in weights)  # plain LookAround names: merged
    before = load_file(out / "init_from" / "model.safetensors")
    moved = [k for k in before if not torch.equal(before[k], weights[k])]
    # only the adapted projections moved (merged in); embeddings and norms were frozen
    assert moved and all(k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj") for k in moved), moved
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


def test_init_from_continues_a_lookaround_checkpoint_and_refuses_what_it_cannot_use(sources, tmp_path, capsys):
    first = tmp_path / "first"
    assert pretrain(sources, first, "llama", "vmlm") == 0
    # a LookAround checkpoint is read as it is (no conversion folder)
    out = tmp_path / "second"
    args = ["pretrain", "--init_from", str(first), "--train_files", str(sources / "train.jsonl.gz"), "--block_size",
            "16", "--objective", "vmlm", "--per_device_train_batch_size", "4", "--max_train_samples", "8",
            "--max_steps", "1", "--do_train", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true",
            "--save_strategy", "no", "--output_dir", str(out)]
    assert cli_main(args) == 0 and not (out / "init_from").exists()
    line = one_line_error(capsys, [*args[:-1], str(tmp_path / "third"), "--model_name_or_path", str(first)])
    assert "--init_from replaces --model_name_or_path" in line
    line = one_line_error(capsys, [*args[:-1], str(tmp_path / "fourth"), "--lora_r", "2", "--lora_target_modules",
                                   "q_proj,c_attn"])
    assert "c_attn" in line and "no such module" in line


def test_other_forms_start_from_a_gpt2_and_an_adapted_ar_checkpoint_exports_back(sources, tmp_path):
    """The two-stream dar form and BERT's [MASK] form from a GPT-2 (learned positions, LayerNorm, Conv1D weights);
    GPT's single-stream ar from a Qwen2, whose result is still a Qwen2 forward: export writes it back, exactly."""
    import transformers

    save_source(sources / "gpt2", "gpt2_tied")
    for objective in ("dar_two_stream", "vmlm_one_stream"):
        out = tmp_path / objective
        assert pretrain(sources, out, "gpt2", objective) == 0 and changed(out)
        assert json.loads((out / "config.json").read_text())["position_embedding_type"] == "absolute"
    check_decodes_and_infills(tmp_path / "vmlm_one_stream", "vmlm")

    out = tmp_path / "ar"
    assert pretrain(sources, out, "qwen2", "ar_one_stream") == 0 and changed(out)
    assert cli_main(["export", str(out), "-o", str(tmp_path / "exported")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    adapted = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-4)


def test_attention_annealing_reaches_the_model_for_its_steps_and_is_refused_where_it_means_nothing(
        sources, tmp_path, capsys, monkeypatch):
    """--attention_annealing_steps 2: steps 0 and 1 carry the keys revealed at progress 0 and 1/2 (the two-stream
    vmlm run drops unread content, so its keys are the kept rows at their positions; dar's one-stream run takes a
    mask of its own batch instead of the one built once), step 2 the plain objective."""
    from hf_lookaround.training.pretraining import LookAroundTrainer

    seen = []
    original = LookAroundTrainer.with_attention_annealing

    def spy(self, training, config, inputs):
        out = original(self, training, config, inputs)
        seen.append((self.state.global_step, out.get("revealed_keys")))
        return out

    monkeypatch.setattr(LookAroundTrainer, "with_attention_annealing", spy)
    for objective in ("vmlm", "dar_one_stream"):
        seen.clear()
        out = tmp_path / objective
        assert pretrain(sources, out, "llama", objective, "--attention_annealing_steps", "2", "--max_steps", "3") == 0
        assert changed(out)
        assert [step for step, _ in seen] == [0, 1, 2]
        (_, at_zero), (_, at_half), (_, after) = seen
        assert at_zero is not None and not at_zero.any()
        assert at_half is not None and 0 < at_half.float().mean() < 1
        assert after is None
    for objective in ("ar_one_stream", "dar_two_stream"):
        line = one_line_error(capsys, ["pretrain", "--init_from", str(sources / "llama"), "--train_files",
                                       str(sources / "train.jsonl.gz"), "--block_size", "16", *OBJECTIVES[objective],
                                       "--max_steps", "1", "--use_cpu", "true", "--report_to", "none",
                                       "--output_dir", str(tmp_path / f"refused_{objective}"),
                                       "--attention_annealing_steps", "2"])
        assert "nothing to anneal" in line, line


def test_a_lora_run_resumes_to_the_weights_and_losses_of_the_uninterrupted_run(sources, tmp_path, capsys):
    """--lora_r with --resume_from_checkpoint: a checkpoint holds the merged weights (a plain LookAround checkpoint
    of that step) and, apart, the adapters with the frozen weights they sit on; the Trainer restores them with the
    optimizer, schedule and RNG, and the run ends where an uninterrupted one does."""
    from safetensors.torch import load_file
    from transformers import AutoModelForPreTraining

    from hf_lookaround.adaptation import LORA_STATE_NAME

    common = ("--lora_r", "4", "--learning_rate", "5e-2", "--max_steps", "4", "--save_strategy", "steps",
              "--save_steps", "2", "--logging_steps", "1", "--seed", "3", "--lora_dropout", "0.1")
    straight = tmp_path / "straight"
    assert pretrain(sources, straight, "qwen2", "vmlm", *common) == 0
    adapters = load_file(straight / "checkpoint-2" / LORA_STATE_NAME)
    assert any("lora_A" in k for k in adapters) and any("lora_B" in k for k in adapters)
    assert any(".base_layer." in k for k in adapters)
    AutoModelForPreTraining.from_pretrained(straight / "checkpoint-2")  # plain names: loads as any checkpoint
    resumed = tmp_path / "resumed"
    assert pretrain(sources, resumed, "qwen2", "vmlm", *common,
                    "--resume_from_checkpoint", str(straight / "checkpoint-2")) == 0

    def losses(out):
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        return {h["step"]: h["loss"] for h in history if "loss" in h}

    reference, curve = losses(straight), losses(resumed)
    assert sorted(reference) == [1, 2, 3, 4] and len(set(reference.values())) > 2
    assert [curve[s] for s in (3, 4)] == pytest.approx([reference[s] for s in (3, 4)], abs=1e-5)
    final, again = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert final.keys() == again.keys() and not any("lora_" in k for k in final)  # merged, as without resume
    for name in final:
        torch.testing.assert_close(again[name], final[name], rtol=0, atol=1e-6)
    before = load_file(straight / "init_from" / "model.safetensors")
    assert any(not torch.equal(before[k], final[k]) for k in before)  # the adapters trained something
    # a LoRA checkpoint resumed without the adapters: one line
    line = one_line_error(capsys, ["pretrain", "--init_from", str(sources / "qwen2"), "--train_files",
                                   str(sources / "train.jsonl.gz"), "--block_size", "16", *OBJECTIVES["vmlm"],
                                   "--max_steps", "4", "--use_cpu", "true", "--report_to", "none", "--learning_rate",
                                   "5e-2", "--output_dir", str(tmp_path / "no_lora"), "--resume_from_checkpoint",
                                   str(straight / "checkpoint-2")])
    assert "LoRA run" in line and "--lora_r" in line, line
    # the last checkpoint's merged weights are the final model's (computed merge = peft's merge at the end)
    last = load_file(straight / "checkpoint-4" / "model.safetensors")
    for name in final:
        torch.testing.assert_close(last[name], final[name], rtol=0, atol=1e-6)
