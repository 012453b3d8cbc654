"""Auto registration (auto_registration.py): `pipeline("image-classification", model=DIR)` on a LookAround ViT
classifier loads without asking "run the custom code? [y/N]" once `hf_lookaround` is imported (issue 23, item 13):
the prompt waited on stdin (15 s, or for ever under some launchers) for a video processor that does not exist."""

import subprocess
import sys

import numpy as np

from conftest import HUNG_CHILD_SECONDS  # a guard against a hung child, not a speed test

CODE = """
import hf_lookaround
from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline
from hf_lookaround import LookAroundViTConfig
from PIL import Image
import numpy as np
config = LookAroundViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=1,
                             num_attention_heads=2, intermediate_size=64, num_labels=3)
AutoModelForImageClassification.from_config(config).save_pretrained(DIR)
from hf_lookaround.models.lookaround.image_processing_lookaround_vit import LookAroundViTImageProcessor
LookAroundViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5],
                            num_channels=1).save_pretrained(DIR)
clf = pipeline("image-classification", model=DIR)
print("RESULT", len(clf(Image.fromarray(np.zeros((8, 8), np.uint8), "L"))))
"""


def test_image_classification_pipeline_asks_nothing(tmp_path):
    folder = tmp_path / "vit"
    proc = subprocess.Popen([sys.executable, "-c", f"DIR = {str(folder)!r}\n" + CODE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=HUNG_CHILD_SECONDS)  # stdin stays open and silent, as a terminal nobody answers
    finally:
        proc.kill()
    assert "auto_map" in (folder / "preprocessor_config.json").read_text()  # remote code is still written
    assert "Do you wish to run the custom code" not in out, out[-2000:]
    assert proc.returncode == 0 and "RESULT 3" in out, out[-2000:]
