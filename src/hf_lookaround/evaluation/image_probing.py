"""Linear probes of frozen image features: :func:`linear_probe_images` (pooled features + logistic regression,
``model=None`` probes raw pixels) with three solvers of the regression (scikit-learn, scikit-learn warm-started
along the C grid, or L-BFGS in torch on the model's device).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)



PROBE_BACKENDS = ("sklearn", "sklearn_path", "torch")


def no_class_labels(config, batch: int, device) -> dict:
    """``class_labels`` of -1 (no class) for a model whose condition tokens carry a class, else nothing: a
    probe or a classifier must never be told the class it is asked for."""
    if getattr(config, "num_condition_tokens", 0) and getattr(config, "num_condition_classes", 0):
        return {"class_labels": torch.full((batch,), -1, dtype=torch.long, device=device)}
    return {}


@torch.inference_mode()
def extract_image_features(model, images: torch.Tensor, batch_size: int = 256) -> np.ndarray:
    """Frozen pooled features ``(N, hidden)`` (``config.classifier_pooling``), single-stream bidirectional
    (condition tokens, if any, carry no class)."""
    vit = model.base_model.eval()
    device = next(vit.parameters()).device
    feats = []
    for i in range(0, len(images), batch_size):
        x = images[i : i + batch_size].to(device)
        feats.append(vit(x, **no_class_labels(vit.config, len(x), device)).pooler_output.float().cpu())
    return torch.cat(feats).numpy()


def torch_logistic_probe(train_feats, train_y, val_feats, val_y, test_feats=None, test_y=None, Cs=None,
                         device=None, max_iter: int = 100) -> dict:
    """The probe of :func:`hf_lookaround.evaluation.probing.linear_probe` (standardised features, multinomial
    logistic regression with sklearn's penalty ``0.5 |W|^2 + C * sum of losses``, bias unpenalised, ``C``
    picked on validation accuracy, ties to the stronger penalty) solved with full-batch L-BFGS in torch, on
    ``device`` (a GPU takes seconds where scikit-learn takes a minute per probe of 10,000 images).

    ``max_iter`` caps L-BFGS iterations per ``C`` (scikit-learn's default, 100; each fit starts from the last):
    several probes sharing one GPU time-slice every small kernel, and 1,000 iterations per ``C`` took 200 s
    per probe with 11 processes on one H100 for a 0.001 change in accuracy."""
    from .probing import DEFAULT_CS

    Cs = list(DEFAULT_CS if Cs is None else Cs)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def tensor(a, dtype=torch.float32):
        return torch.as_tensor(np.asarray(a), dtype=dtype, device=device)

    x, y = tensor(train_feats), tensor(train_y, torch.long)
    if len(torch.unique(y)) < 2:
        raise ValueError("the train split has a single class; a probe needs at least two")
    mean, std = x.mean(0), x.std(0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))  # StandardScaler leaves constant features unscaled

    def standardise(f):
        return (tensor(f) - mean) / std

    x, xv, yv = standardise(train_feats), standardise(val_feats), tensor(val_y, torch.long)
    num_classes = int(max(y.max(), yv.max())) + 1
    weight = torch.zeros(x.shape[1], num_classes, device=device, requires_grad=True)
    bias = torch.zeros(num_classes, device=device, requires_grad=True)
    fitted, val_scores = {}, {}
    for c in sorted(Cs):  # weaker and weaker penalty, each fit starting from the last one
        optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, history_size=20,
                                      tolerance_grad=1e-5, tolerance_change=1e-10, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            # sklearn's objective divided by C * n: the mean loss plus |W|^2 / (2 C n)
            loss = torch.nn.functional.cross_entropy(x @ weight + bias, y) + weight.square().sum() / (2 * c * len(x))
            loss.backward()
            return loss

        optimizer.step(closure)
        fitted[c] = (weight.detach().clone(), bias.detach().clone())
        val_scores[c] = float(((xv @ fitted[c][0] + fitted[c][1]).argmax(-1) == yv).float().mean())
    best = max(Cs, key=lambda v: (val_scores[v], -Cs.index(v)))
    result = {"task_type": "classification", "C": float(best), "num_train": int(len(y)), "metric": "accuracy",
              "validation_accuracy": val_scores[best], "solver": f"torch L-BFGS on {device.type}"}
    if test_feats is not None and test_y is not None:
        w, b = fitted[best]
        acc = float(((standardise(test_feats) @ w + b).argmax(-1) == tensor(test_y, torch.long)).float().mean())
        result.update(test_accuracy=acc, test_accuracy_se=float(np.sqrt(acc * (1 - acc) / len(test_y))))
    return result


def warm_path_probe(train_feats, train_y, val_feats, val_y, test_feats=None, test_y=None, Cs=None) -> dict:
    """The probe of :func:`hf_lookaround.evaluation.probing.linear_probe` (standardised features, scikit-learn's
    multinomial ``LogisticRegression``, ``C`` picked on validation accuracy, ties to the stronger penalty), on the
    CPU, with each ``C`` of the grid (ascending) started from the solution of the previous one (``warm_start``):
    the same objective and optimum, in about a third of the iterations. Needs no GPU: many runs sharing one GPU
    slow a GPU solver's many tiny steps down far more than the CPU."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from .probing import DEFAULT_CS

    Cs = sorted(DEFAULT_CS if Cs is None else Cs)
    train_y, val_y = np.asarray(train_y), np.asarray(val_y)
    if len(np.unique(train_y)) < 2:
        raise ValueError("the train split has a single class; a probe needs at least two")
    scaler = StandardScaler().fit(train_feats)
    x, xv = scaler.transform(train_feats), scaler.transform(val_feats)
    xt = scaler.transform(test_feats) if test_feats is not None else None
    model = LogisticRegression(C=Cs[0], max_iter=2000, warm_start=True, random_state=0)
    val_scores, test_scores = {}, {}
    for c in Cs:
        model.set_params(C=c).fit(x, train_y)
        val_scores[c] = float((model.predict(xv) == val_y).mean())
        if xt is not None and test_y is not None:
            test_scores[c] = float((model.predict(xt) == np.asarray(test_y)).mean())
    best = max(Cs, key=lambda v: (val_scores[v], -Cs.index(v)))
    result = {"task_type": "classification", "C": float(best), "num_train": int(len(train_y)), "metric": "accuracy",
              "validation_accuracy": val_scores[best], "solver": "scikit-learn lbfgs, warm start along C"}
    if test_scores:
        acc = test_scores[best]
        result.update(test_accuracy=acc, test_accuracy_se=float(np.sqrt(acc * (1 - acc) / len(test_y))))
    return result


def linear_probe_images(model, images, labels, test_images=None, test_labels=None, validation_fraction: float = 0.2,
                        seed: int = 0, batch_size: int = 256, backend: str = "sklearn") -> dict:
    """Logistic regression on frozen features (``model=None``: raw pixels); ``C`` picked on a held-out
    ``validation_fraction`` of ``images``; test accuracy on ``test_images`` if given. ``backend``:
    ``sklearn`` (:func:`hf_lookaround.evaluation.probing.linear_probe`), ``sklearn_path``
    (:func:`warm_path_probe`: the same, warm-started along the ``C`` grid) or ``torch``
    (:func:`torch_logistic_probe`, the same objective on the model's device)."""
    from .probing import linear_probe

    if backend not in PROBE_BACKENDS:
        raise ValueError(f"backend must be one of {PROBE_BACKENDS}, got {backend!r}")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction}")

    def featurise(x):
        return x.flatten(1).numpy() if model is None else extract_image_features(model, x, batch_size)

    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(validation_fraction * len(images))))
    val, train = order[:n_val], order[n_val:]
    feats = featurise(images)
    test_feats = featurise(test_images) if test_images is not None else None
    labels = np.asarray(labels)
    if backend == "sklearn_path":
        return warm_path_probe(feats[train.numpy()], labels[train.numpy()], feats[val.numpy()], labels[val.numpy()],
                               test_feats, None if test_labels is None else np.asarray(test_labels))
    if backend == "torch":
        device = next(model.parameters()).device if model is not None else None
        return torch_logistic_probe(feats[train.numpy()], labels[train.numpy()], feats[val.numpy()],
                                    labels[val.numpy()], test_feats,
                                    None if test_labels is None else np.asarray(test_labels), device=device)
    return linear_probe(feats[train.numpy()], labels[train.numpy()], feats[val.numpy()], labels[val.numpy()],
                        test_feats, None if test_labels is None else np.asarray(test_labels), seed=seed)
