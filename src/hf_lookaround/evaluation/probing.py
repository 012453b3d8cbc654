"""Linear probing of frozen features: ``hf-lookaround probe`` (paper (a) §3.3, Thm 4.1).

The backbone is frozen; each text becomes one vector (pooling: ``mean`` over real tokens, ``last``
real token, or ``cls`` = the first token) of a named state (``features``, ``models/lookaround/features_lookaround.py``):
``prediction_state``, the state that predicts in the checkpoint's own training layout (a two-stream checkpoint's
query stream), or ``content_last_layer``, the content stream's last layer under a chosen attention pattern (as
pretrained, i.e. ``config.default_attention``, or forced ``causal`` / ``bidirectional``). ``all_layers`` gives the
same state after the embeddings and after every layer. A scikit-learn model is fitted
on top of standardised features: logistic regression for classes (``C`` chosen on the validation
split), ridge regression for real-valued labels (``alpha`` chosen on validation, Pearson / Spearman).

Long texts are truncated to the model's maximum length *explicitly*: the number of truncated
examples is logged and written to the results.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["POOLINGS", "FEATURES", "DEFAULT_CS", "DEFAULT_ALPHAS", "count_truncated", "extract_features",
           "linear_probe", "linear_probe_layers"]

FEATURES = ("prediction_state", "content_last_layer")  # features_lookaround.FEATURES (checked equal in the tests)

POOLINGS = ("mean", "last", "cls")
DEFAULT_CS = tuple(10.0**e for e in range(-4, 3))  # 1e-4 ... 1e2
DEFAULT_ALPHAS = tuple(10.0**e for e in range(-2, 5))  # 1e-2 ... 1e4


def max_length_for(model, tokenizer, max_length: int | None, features: str = "content_last_layer") -> int:
    """The longest input the features take: the model's positions (less the one a look-ahead prediction state reads
    past the input), the tokenizer's limit, or ``max_length`` if it fits."""
    limit = getattr(model.config, "max_position_embeddings", None) or 512
    if getattr(model.config, "model_type", None) == "lookaround":
        from hf_lookaround.models.lookaround.features_lookaround import positions_past_input

        limit -= positions_past_input(model.config, features)
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if tok_limit and tok_limit < 1e9:  # transformers uses a huge sentinel for "no limit"
        limit = min(limit, tok_limit)
    if max_length is None:
        return limit
    if max_length > limit:
        raise ValueError(f"max_length={max_length} exceeds what the model accepts ({limit} positions)")
    return max_length


def count_truncated(tokenizer, texts, max_length: int, text_pairs=None) -> int:
    """How many examples are longer than ``max_length`` tokens (special tokens included)."""
    from hf_lookaround.data.tokenization import encode_sentences

    lengths = [len(ids) for ids in encode_sentences(tokenizer, texts, text_pairs)["input_ids"]]
    return sum(n > max_length for n in lengths)


@torch.inference_mode()
def extract_features(
    model,
    tokenizer,
    texts,
    pooling: str = "mean",
    attention_pattern: str | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    text_pairs=None,
    features: str = "content_last_layer",
    all_layers: bool = False,
) -> np.ndarray:
    """Frozen pooled features ``(N, hidden)`` of ``texts`` (optionally sentence pairs), or with ``all_layers``
    ``(num_hidden_layers + 1, N, hidden)``: after the embeddings and after each layer.

    ``features``: ``content_last_layer`` (the default: what probes read before issue 42) or ``prediction_state``
    (``features_lookaround``). ``attention_pattern`` (``causal`` / ``bidirectional``; None = as pretrained) applies
    to ``content_last_layer`` of a LookAround model; other ``AutoModel`` backbones run as they are, and offer
    ``content_last_layer`` only (their last hidden state).
    """
    from hf_lookaround.data.tokenization import encode_sentences
    from hf_lookaround.models.lookaround.features_lookaround import check_features, token_states
    from hf_lookaround.models.lookaround.modeling_lookaround import pool

    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    check_features(features)
    backbone = model.base_model  # the encoder of a head model, or the model itself
    is_lookaround = getattr(backbone.config, "model_type", None) == "lookaround"
    if attention_pattern is not None and not is_lookaround:
        raise ValueError(
            f"attention_pattern={attention_pattern!r} needs a LookAround model; "
            f"{type(backbone).__name__} has a fixed pattern (pass None)"
        )
    if not is_lookaround and (features != "content_last_layer" or all_layers):
        raise ValueError(f"features={features!r} and all_layers need a LookAround model; "
                         f"{type(backbone).__name__} offers features='content_last_layer' only")
    max_length = max_length_for(backbone, tokenizer, max_length, features)
    texts = list(texts)
    text_pairs = list(text_pairs) if text_pairs is not None else None
    truncated = count_truncated(tokenizer, texts, max_length, text_pairs)
    if truncated:
        logger.warning("truncating %d of %d examples to max_length=%d tokens", truncated, len(texts), max_length)

    backbone.eval()
    device = next(backbone.parameters()).device
    pooled = []
    for i in range(0, len(texts), batch_size):
        pairs = text_pairs[i : i + batch_size] if text_pairs is not None else None
        enc = encode_sentences(tokenizer, texts[i : i + batch_size], pairs, padding=True, truncation=True,
                               max_length=max_length, return_tensors="pt")
        enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        if is_lookaround:
            tables = token_states(backbone, enc["input_ids"], enc["attention_mask"], features, attention_pattern,
                                  all_layers)
        else:
            tables = backbone(**enc).last_hidden_state
        tables = tables if all_layers else [tables]
        pooled.append(torch.stack([pool(h, enc["attention_mask"], pooling).float().cpu() for h in tables]))
    stacked = torch.cat(pooled, dim=1).numpy()
    return stacked if all_layers else stacked[0]


def linear_probe(
    train_feats,
    train_y,
    val_feats,
    val_y,
    test_feats=None,
    test_y=None,
    task_type: str = "classification",
    Cs=DEFAULT_CS,
    alphas=DEFAULT_ALPHAS,
    seed: int = 0,
    return_predictions: bool = False,
) -> dict:
    """Fit on train, pick ``C`` (or ``alpha``) on validation, report validation and test scores.

    Features are standardised with the train statistics (logistic regression is not scale-invariant).
    Classification reports ``test_accuracy_se``, the binomial standard error ``sqrt(acc (1 - acc) / n)``;
    ``return_predictions`` adds ``test_predictions`` (one per test row), for paired comparisons.
    """
    train_y, val_y = _checked_labels(task_type, train_feats, train_y, val_feats, val_y)
    fit, score, grid, name = _probe_family(task_type, train_feats, train_y, Cs, alphas, seed)
    fitted = {value: fit(value) for value in grid}
    val_scores = {value: score(m, val_feats, val_y) for value, m in fitted.items()}
    best = max(grid, key=lambda v: (val_scores[v], -grid.index(v)))  # ties: the stronger regularisation
    model = fitted[best]
    result = {"task_type": task_type, name: float(best), "num_train": int(len(train_y))}
    if task_type == "classification":
        result.update(_classification_scores(model, score, val_scores, best, train_feats, train_y, test_feats, test_y,
                                             return_predictions))
    else:
        result.update(_regression_scores(model, val_scores, val_feats, val_y, test_feats, test_y, return_predictions))
    return result


def _checked_labels(task_type: str, train_feats, train_y, val_feats, val_y):
    """The train and validation labels as arrays, once the task type and the row counts are checked."""
    if task_type not in ("classification", "regression"):
        raise ValueError(f"task_type must be 'classification' or 'regression', got {task_type!r}")
    train_y, val_y = np.asarray(train_y), np.asarray(val_y)
    if len(train_feats) != len(train_y) or len(val_feats) != len(val_y):
        raise ValueError("features and labels must have the same number of rows in every split")
    return train_y, val_y


def _probe_family(task_type: str, train_feats, train_y, Cs, alphas, seed: int):
    """``(fit, score, grid, name)``: fit a probe on the standardised train features for one value of the grid,
    score one on a split, the grid to choose from on validation and its parameter's name."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if task_type == "classification":
        if len(np.unique(train_y)) < 2:
            raise ValueError("the train split has a single class; a probe needs at least two")

        def fit(c):
            return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000, random_state=seed)).fit(
                train_feats, train_y
            )

        def score(m, x, y):
            return float((m.predict(x) == np.asarray(y)).mean())

        return fit, score, list(Cs), "C"

    def fit(a):
        return make_pipeline(StandardScaler(), Ridge(alpha=a)).fit(train_feats, train_y.astype(float))

    def score(m, x, y):
        return _correlations(m.predict(x), y)["pearson"]

    return fit, score, list(alphas), "alpha"


def _classification_scores(model, score, val_scores, best, train_feats, train_y, test_feats, test_y,
                           return_predictions: bool) -> dict:
    """Accuracy on validation, train and test, the test accuracy's binomial standard error, the test predictions."""
    scores = dict(
        metric="accuracy",
        validation_accuracy=val_scores[best],
        train_accuracy=score(model, train_feats, train_y),
        validation_scores={str(k): v for k, v in val_scores.items()},
    )
    if test_feats is not None:
        accuracy = score(model, test_feats, test_y)
        scores["test_accuracy"] = accuracy
        scores["test_accuracy_se"] = float(np.sqrt(accuracy * (1 - accuracy) / max(1, len(test_feats))))
        if return_predictions:
            scores["test_predictions"] = model.predict(test_feats).tolist()
    return scores


def _regression_scores(model, val_scores, val_feats, val_y, test_feats, test_y, return_predictions: bool) -> dict:
    """Pearson and Spearman correlations on validation and test, the test predictions."""
    val = _correlations(model.predict(val_feats), val_y)
    scores = dict(
        metric="pearson",
        validation_pearson=val["pearson"],
        validation_spearman=val["spearman"],
        validation_scores={str(k): v for k, v in val_scores.items()},
    )
    if test_feats is not None:
        predictions = model.predict(test_feats)
        test = _correlations(predictions, test_y)
        scores.update(test_pearson=test["pearson"], test_spearman=test["spearman"])
        if return_predictions:
            scores["test_predictions"] = predictions.tolist()
    return scores


def linear_probe_layers(train_layers, train_y, val_layers, val_y, test_layers=None, test_y=None, **kwargs) -> list:
    """:func:`linear_probe` on every layer's features (``extract_features(..., all_layers=True)``): one result per
    table, ``layer`` 0 being the embeddings; each layer chooses its own ``C`` / ``alpha`` on validation."""
    results = []
    for layer in range(len(train_layers)):
        test = test_layers[layer] if test_layers is not None else None
        results.append({"layer": layer, **linear_probe(train_layers[layer], train_y, val_layers[layer], val_y, test,
                                                       test_y, **kwargs)})
    return results


def _correlations(pred, gold) -> dict:
    from scipy.stats import pearsonr, spearmanr

    pred, gold = np.asarray(pred, dtype=float), np.asarray(gold, dtype=float)
    if np.std(pred) == 0:  # a constant prediction has no correlation; count it as 0, not NaN
        return {"pearson": 0.0, "spearman": 0.0}
    return {"pearson": float(pearsonr(pred, gold)[0]), "spearman": float(spearmanr(pred, gold)[0])}
