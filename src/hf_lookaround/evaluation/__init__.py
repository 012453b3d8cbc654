"""Evaluation harness: perplexity (AR and masked), linear probing, GLUE-style fine-tuning.

Each area is a reusable API; its command (``hf-lookaround perplexity | probe | glue``) is in :mod:`hf_lookaround.cli`:

- :mod:`.perplexity`: ``ar_perplexity``, ``masked_perplexity`` (sliding windows, bits per byte,
  perplexity against the prefix length);
- :mod:`.probing`: ``extract_features`` (frozen, pooled) and ``linear_probe`` (scikit-learn);
- :mod:`.glue`: fine-tuning with ``Trainer``, fully or with LoRA, GLUE metrics through ``evaluate``;
- :mod:`.tasks`: loading text and sentence/label data from local files or ``datasets``;
- :mod:`.image_probing`: linear probes of frozen ViT features (three solvers);
- :mod:`.reconstruction`: reconstruction L2 of masked images, group by group.

Submodules are imported on use, so ``import hf_lookaround.evaluation`` stays cheap.
"""

import importlib

_EXPORTS = {
    "ar_perplexity": "perplexity",
    "masked_perplexity": "perplexity",
    "PerplexityResult": "perplexity",
    "extract_features": "probing",
    "linear_probe": "probing",
    "glue_metric_path": "glue",
    "load_glue_metric": "glue",
    "find_lora_target_modules": "glue",
    "load_texts": "tasks",
    "load_labeled_splits": "tasks",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
