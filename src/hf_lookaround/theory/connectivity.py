"""Connectivity of trained models: the surrogate of paper (a) Fig. 2 (App. B.2).

Features of ``N`` held-out samples (the mean-pooled last hidden state of ``AutoModel``), every
pairwise inner product, the ``top`` largest of them, and their distribution per model. More mass
at large inner products means samples that the model links more strongly: the paper reads it as
more inter-sample connectivity.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["mean_pooled_features", "top_pair_products", "plot_connectivity"]


@torch.no_grad()
def mean_pooled_features(
    model_path, texts: list[str], max_length: int = 128, batch_size: int = 16, device: str | None = None
) -> np.ndarray:
    """``(N, D)``: mean over non-padding tokens of ``AutoModel(path)(...).last_hidden_state``.

    The tokenizer is loaded from the same directory. Any checkpoint whose ``AutoModel`` returns
    ``last_hidden_state`` works; LookAround checkpoints run their default attention
    (``config.default_attention``: causal for AR checkpoints, bidirectional for masked ones)."""
    from transformers import AutoModel, AutoTokenizer

    from ..data.tokenization import encode_sentences
    from ..hub.load import load_checkpoint

    if not texts:
        raise ValueError("no texts to embed")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ValueError(f"the tokenizer in {model_path} has no pad, eos or unk token to pad batches with")
        tokenizer.pad_token = fallback
    tokenizer.padding_side = "right"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_checkpoint(AutoModel, model_path, "hf-lookaround theory", kinds=("text", "other")).to(device).eval()
    features = []
    for start in range(0, len(texts), batch_size):
        batch = encode_sentences(
            tokenizer,
            texts[start : start + batch_size],
            max_length=max_length,
            truncation=True,
            padding=True,
            return_tensors="pt",
        ).to(device)
        batch.pop("token_type_ids", None)
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        features.append(((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu())
    return torch.cat(features).numpy()


def top_pair_products(features: np.ndarray, top: int = 100_000, normalize: bool = True) -> np.ndarray:
    """The ``top`` largest inner products over all pairs ``i < j`` of rows, largest first.

    ``normalize`` rescales every feature to unit norm first (cosine similarity), which makes
    models of different feature scales comparable on one axis."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"need features of shape (N >= 2, D), got {x.shape}")
    if normalize:
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    products = (x @ x.T)[np.triu_indices(x.shape[0], k=1)]
    top = min(top, products.size)
    return np.sort(np.partition(products, products.size - top)[-top:])[::-1]


def plot_connectivity(distributions: dict[str, np.ndarray], path, bins: int = 100, title: str | None = None) -> Path:
    """Histograms (densities) of the top inner products of several models on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in distributions.items():
        ax.hist(values, bins=bins, density=True, histtype="step", linewidth=1.5, label=f"{name} (n={len(values)})")
    ax.set_xlabel("inner product of features (top pairs)")
    ax.set_ylabel("density")
    ax.set_title(title or "Connectivity surrogate (paper (a) Fig. 2)")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
