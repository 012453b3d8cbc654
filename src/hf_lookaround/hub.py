"""Share checkpoints on the Hugging Face Hub: model cards, remote code, `hf-lookaround push`, a checked loader.

- :func:`write_model_card` renders ``README.md`` next to a checkpoint from the templates in
  ``hf_lookaround/cards`` (one per model family) through ``huggingface_hub.ModelCard``, with the
  results that the evaluation commands left in the folder (:func:`collect_results`).
- :func:`push_checkpoint` (and ``hf-lookaround push``) uploads weights, config, tokenizer, card and
  the remote-code files with ``HfApi.create_repo`` + ``HfApi.upload_folder``. The local checkpoint is
  never modified: missing pieces (card, remote code, ``auto_map``) are generated in a staging folder.
- :func:`load_pretrained` checks the weights files (present, valid safetensors) before handing over
  to ``AutoModel*.from_pretrained``, so a broken repo fails with a message that names the file.

Remote code: a user without this package loads a checkpoint with
``AutoModel*.from_pretrained(repo, trust_remote_code=True)``; transformers then downloads the
modules named in ``config.json["auto_map"]`` and, recursively, the files they import with
``from .module import ...`` (the only relative form it follows). :func:`ensure_remote_code` makes
sure those files are all there and that none imports ``hf_lookaround`` itself.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import inspect
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "HEADS",
    "CITATION",
    "HubPushError",
    "collect_results",
    "build_model_card",
    "write_model_card",
    "model_family",
    "ensure_remote_code",
    "check_weights",
    "push_checkpoint",
    "push_trainer_output",
    "load_pretrained",
    "main",
]

logger = logging.getLogger(__name__)

CARD_DIR = Path(__file__).resolve().parent / "cards"
CARD_TEMPLATES = {"two-stream": "two_stream.md", "masked": "masked.md", "vision": "vision.md"}

# head name (for load_pretrained / the card) -> (Auto class, LookAround class)
HEADS = {
    "base": ("AutoModel", "LookAroundModel"),
    "pretraining": ("AutoModelForPreTraining", "LookAroundForPreTraining"),
    "masked-lm": ("AutoModelForMaskedLM", "LookAroundForMaskedLM"),
    "causal-lm": ("AutoModelForCausalLM", "LookAroundForCausalLM"),
    "sequence-classification": ("AutoModelForSequenceClassification", "LookAroundForSequenceClassification"),
}
CONFIG_MODULE, MODEL_MODULE = "configuration_lookaround", "modeling_lookaround"
CONFIG_CLASS = "LookAroundConfig"
VIT_HEADS = {
    "base": ("AutoModel", "LookAroundViTModel"),
    "pretraining": ("AutoModelForPreTraining", "LookAroundViTForPreTraining"),
    "image-classification": ("AutoModelForImageClassification", "LookAroundViTForImageClassification"),
}
# model_type -> (config module, config class, model module, heads): what a checkpoint's remote code is
REMOTE_CODE = {
    "lookaround": (CONFIG_MODULE, CONFIG_CLASS, MODEL_MODULE, HEADS),
    "lookaround_vit": ("configuration_lookaround_vit", "LookAroundViTConfig", "modeling_lookaround_vit", VIT_HEADS),
}

# What each objective is, in the words of DESIGN.md; the family picks the card template.
OBJECTIVES = {
    "ar": ("two-stream", "autoregressive (AR, \"look ahead\")",
           "`g[i] = i`: each token is predicted from the tokens before it; targets are positions `i >= 1`."),
    "dar": ("two-stream", "diversity-enhanced autoregressive / semi-autoregressive (DAR)",
            "the first group, of size `s1 ~ U{1..t}`, has rank 0; then consecutive groups of `t` tokens: "
            "`g[i] = 1 + (i - s1) // t`; a group is predicted from all earlier groups (paper (a) Eq. 3 and 6)."),
    "gvp": ("two-stream", "grouped permuted prediction (GVP)",
            "a random order over positions is cut into groups G0..GK; G0 is the condition and each later group "
            "is predicted from all earlier ones (paper (b) §3.2)."),
    "mlm": ("masked", "masked, fixed ratio (\"look around\", BERT/MAE)",
            "unmasked tokens have rank 0, masked tokens rank 1; the masked tokens are predicted from the rest."),
    "vmlm": ("masked", "variable-length masked (VMLM)",
             "as masked, with the ratio drawn per sequence from `U[a, b]` (paper (a) Eq. 5)."),
}

EVALUATION_PROTOCOLS = [
    "**Perplexity, autoregressive**: `p(x_k | x_<k)`, one forward with the AR plan.",
    "**Perplexity of a masked model** (paper (a) Fig. 3, Table 7): `p(x_k | x_<k)` with the prefix visible, "
    "position k masked and nothing after k, reported against the prefix length k too. Pseudo-perplexity "
    "(every token masked in turn, full context) is a different number and is named so when reported.",
    "**Linear probing** (paper (a) §3.3, Thm 4.1): frozen features, a logistic regression on top.",
    "**Fine-tuning**: GLUE-style sentence (pair) classification and regression with `Trainer`, full or with "
    "LoRA (`peft`); metrics as GLUE defines them per task.",
]
VISION_PROTOCOLS = [
    "**Linear probing** (paper (a) §3.3, Thm 4.1): frozen features, a logistic regression on top; accuracy.",
    "**Fine-tuning**: accuracy of the whole network fine-tuned for classification.",
    "**Reconstruction**: L2 error of masked images, predicted group by group (paper (a) Table 8, paper (b) Table 8).",
]

# Paper (b)'s authors could not be verified offline: see the TODO in docs/hub.md. Do not invent them.
CITATION = """\
@inproceedings{zhang2024look,
  title     = {Look Ahead or Look Around? A Theoretical Comparison Between Autoregressive and Masked Pretraining},
  author    = {Zhang, Qi and Du, Tianqi and Huang, Haotian and Wang, Yifei and Wang, Yisen},
  booktitle = {Proceedings of the 41st International Conference on Machine Learning (ICML)},
  year      = {2024},
  eprint    = {2407.00935},
  archivePrefix = {arXiv}
}

@misc{gvp,
  title = {Generative Visual Pretraining with grouped permutation (GVP)},
  note  = {paper (b) of hf_lookaround's design; full reference to be completed}
}"""

# The card's load snippets name the repo; before a push the checkpoint has none yet.
REPO_PLACEHOLDER = "<namespace>/<model-name>"
# Metadata key holding the arguments a card was rendered with, so that a push can re-render it.
CARD_ARGS_KEY = "hf_lookaround"

# Trainer state and pickles never go to the Hub; weights go as safetensors.
EXCLUDED_FILES = ("optimizer.*", "scheduler.*", "scaler.*", "rng_state*", "*.pt", "*.pth", "*.bin", "*.ckpt",
                  ".*", "*.lock")


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        logger.warning("ignoring %s: not valid JSON (%s)", path, err)
        return None


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# Metric names of the evaluation commands -> (model-index metric type, readable name).
METRIC_NAMES = {
    "loss": ("loss", "held-out loss of the pretraining objective"),
    "perplexity": ("perplexity", "perplexity"),
    "ar_perplexity": ("perplexity", "AR perplexity p(x_k | x_<k)"),
    "masked_perplexity": ("perplexity", "masked-prefix perplexity p(x_k | x_<k)"),
    "pseudo_perplexity": ("pseudo-perplexity", "pseudo-perplexity (every token masked in turn)"),
    "bits_per_byte": ("bits_per_byte", "bits per byte"),
}


def collect_results(checkpoint_dir, dataset: str | None = None, task_type: str = "text-generation") -> list:
    """Evaluation results found in ``checkpoint_dir`` as ``huggingface_hub.EvalResult`` entries.

    Reads whichever of these exist (missing keys are skipped, never an error):

    - ``all_results.json`` / ``eval_results.json`` (transformers' layout, ``{"eval_accuracy": ..}``):
      every ``eval_*`` metric, plus ``perplexity``; on ``dataset`` (the pretraining data), split validation;
    - ``probe_results.json``: ``{"task", "dataset", "metric", "test_<metric>"}`` (or a list of such),
      the linear probe;
    - ``perplexity.json``: ``{"dataset", "ar_perplexity", "masked_perplexity", "bits_per_byte"}``.

    ``task_type`` is the model-index task of the language-modelling numbers (``fill-mask`` for masked models).
    """
    from huggingface_hub import EvalResult

    folder = Path(checkpoint_dir)
    results: list = []
    source = dataset or "pretraining data"

    trainer_metrics = _read_json(folder / "all_results.json") or _read_json(folder / "eval_results.json") or {}
    if isinstance(trainer_metrics, dict):
        skip = ("runtime", "samples_per_second", "steps_per_second", "samples", "epoch")
        for key, value in sorted(trainer_metrics.items()):
            name = key[len("eval_"):] if key.startswith("eval_") else key if key == "perplexity" else None
            if name is None or name in skip or _number(value) is None:
                continue
            metric_type, metric_name = METRIC_NAMES.get(name, (name, f"eval {name}"))
            results.append(EvalResult(
                task_type=task_type, task_name="Pretraining data (held-out)",
                dataset_type=source, dataset_name=source, dataset_split="validation",
                metric_type=metric_type, metric_name=metric_name, metric_value=_number(value),
            ))

    probes = _read_json(folder / "probe_results.json")
    for probe in probes if isinstance(probes, list) else [probes] if isinstance(probes, dict) else []:
        metric = probe.get("metric") or "accuracy"
        value = _number(probe.get(f"test_{metric}", probe.get(metric)))
        if value is None:
            continue
        task, data = probe.get("task"), probe.get("dataset") or probe.get("task") or "unknown"
        results.append(EvalResult(
            task_type="text-classification", task_name=f"Linear probe{f' ({task})' if task else ''}",
            dataset_type=data, dataset_name=data, dataset_split=probe.get("split", "test"),
            metric_type=metric, metric_name=f"linear probe {metric}", metric_value=value,
        ))

    ppl = _read_json(folder / "perplexity.json")
    if isinstance(ppl, dict):
        data = ppl.get("dataset") or source
        for key in ("ar_perplexity", "masked_perplexity", "pseudo_perplexity", "bits_per_byte"):
            value = _number(ppl.get(key))
            metric, label = METRIC_NAMES[key]
            if value is not None:
                results.append(EvalResult(
                    task_type=task_type, task_name="Language modelling",
                    dataset_type=data, dataset_name=data, dataset_split=ppl.get("split", "test"),
                    metric_type=metric, metric_name=label, metric_value=value,
                ))
    return results


# ----------------------------------------------------------------------------------------------
# Model cards
# ----------------------------------------------------------------------------------------------
def model_family(config: dict, objective: str | None = None) -> str:
    """``"two-stream"``, ``"masked"`` or ``"vision"``: which card template describes a checkpoint."""
    if config.get("modality") == "vision" or "patch_size" in config or "image_size" in config:
        return "vision"
    objective = objective or config.get("objective")
    if objective in OBJECTIVES:
        return OBJECTIVES[objective][0]
    # no objective recorded: the attention pattern tells how the model was meant to be used
    return "masked" if config.get("default_attention") == "bidirectional" else "two-stream"


def _default_plan_params(objective: str | None) -> dict:
    """The parameters :func:`plans.make_plan` uses for ``objective`` when none are given."""
    if objective not in OBJECTIVES:
        return {}
    from . import plans

    function = {"ar": plans.autoregressive_plan, "dar": plans.semi_autoregressive_plan,
                "mlm": plans.masked_plan, "vmlm": plans.variable_masked_plan, "gvp": plans.gvp_plan}[objective]
    ignored = {"lengths", "seq_len", "generator", "maskable", "num_condition_tokens"}
    return {
        name: p.default for name, p in inspect.signature(function).parameters.items()
        if name not in ignored and p.default is not inspect.Parameter.empty
    }


def _num_parameters(folder: Path) -> int | None:
    """Parameter count from the safetensors headers (no tensor is read); tied weights are stored once."""
    from safetensors import safe_open

    total = 0
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    try:
        for path in files:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    n = 1
                    for d in f.get_slice(name).get_shape():
                        n *= d
                    total += n
    except Exception:  # a broken file is reported by check_weights, not by the card
        return None
    return total


def _human(n: int | None) -> str | None:
    if n is None:
        return None
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _training_summary(folder: Path) -> dict:
    state = _read_json(folder / "trainer_state.json") or {}
    return {k: state[k] for k in ("global_step", "epoch") if k in state}


def build_model_card(
    checkpoint_dir,
    objective: str | None = None,
    plan_params: dict | None = None,
    dataset: str | list[str] | None = None,
    dataset_description: str | None = None,
    model_id: str | None = None,
    family: str | None = None,
    license: str = "apache-2.0",
    language: str | list[str] | None = "en",
    base_model: str | None = None,
    tags: list[str] | None = None,
):
    """Render the card of the checkpoint in ``checkpoint_dir`` and return a ``huggingface_hub.ModelCard``.

    ``objective`` / ``plan_params`` default to the ``objective`` / ``plan_params`` fields of
    ``config.json``; parameters not given are filled with the defaults of :mod:`hf_lookaround.plans`
    (and marked so). ``dataset`` names the pretraining data (a Hub dataset id goes into the metadata;
    a local name or path is only described). ``model_id`` is the repo id used in the load snippets.
    """
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(checkpoint_dir)
    config = _read_json(folder / "config.json") or {}
    objective = objective or config.get("objective")
    if objective is not None and objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {sorted(OBJECTIVES)} (or leave it None)")
    family = family or model_family(config, objective)
    if family not in CARD_TEMPLATES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(CARD_TEMPLATES)}")

    given = dict(plan_params if plan_params is not None else config.get("plan_params") or {})
    defaults = _default_plan_params(objective)
    plan_rows = [(k, given[k], "") for k in sorted(given)] + [
        (k, v, "default") for k, v in sorted(defaults.items()) if k not in given
    ]
    datasets = [dataset] if isinstance(dataset, str) else list(dataset or [])
    # The Hub's `datasets` metadata takes dataset ids; a local path would be a broken link.
    # ("name:config" is how the pretraining script names a datasets config)
    hub_datasets = [d.split(":")[0] for d in datasets if d.count("/") <= 1 and not os.path.exists(d) and " " not in d]
    model_id = model_id or REPO_PLACEHOLDER
    pipeline_tag = {"two-stream": "text-generation", "masked": "fill-mask", "vision": "image-feature-extraction"}
    eval_results = collect_results(folder, dataset=", ".join(datasets) or None,
                                   task_type=pipeline_tag[family] if family != "vision" else "image-classification")

    card_args = {k: v for k, v in dict(objective=objective, plan_params=given or None, dataset=dataset or None,
                                       dataset_description=dataset_description, family=family).items() if v}
    card_data = ModelCardData(
        language=language,
        license=license,
        library_name="transformers",
        pipeline_tag=pipeline_tag[family],
        tags=sorted({"hf_lookaround", "lookaround", "custom_code", family, *(tags or []),
                     *([objective] if objective else [])}),
        datasets=hub_datasets or None,
        base_model=base_model,
        model_name=model_id if eval_results else None,
        eval_results=eval_results or None,
        **{CARD_ARGS_KEY: card_args},
    )
    architecture = {k: config[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
        "max_position_embeddings", "hidden_act", "norm_type", "position_embedding_type", "default_attention",
        "prediction_stream",
    ) if k in config}
    _, name, plan_text = OBJECTIVES.get(objective, (None, None, None))
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_DIR / CARD_TEMPLATES[family]),
        model_id=model_id,
        family=family,
        objective=objective,
        objective_name=name,
        plan_description=plan_text,
        plan_rows=plan_rows,
        datasets=datasets,
        dataset_description=dataset_description,
        architecture=architecture,
        num_parameters=_human(_num_parameters(folder)),
        training=_training_summary(folder),
        # `|` would end a markdown table cell
        results=[
            {k: str(v).replace("|", "\\|") for k, v in dict(
                task=r.task_name, dataset=r.dataset_name, split=r.dataset_split or "", metric=r.metric_name,
                value=f"{r.metric_value:.4g}").items()}
            for r in eval_results
        ],
        plan_kwargs="".join(f", {k}={v!r}" for k, v in sorted(given.items())),
        # text protocols for text models; a vision model is probed, fine-tuned and scored on reconstruction
        protocols=VISION_PROTOCOLS if family == "vision" else EVALUATION_PROTOCOLS,
        heads=[(head, auto) for head, (auto, _) in (VIT_HEADS if family == "vision" else HEADS).items()],
        citation=CITATION,
    )


def write_model_card(checkpoint_dir, objective=None, plan_params=None, dataset=None, **kwargs) -> Path:
    """Write ``README.md`` (the model card) into ``checkpoint_dir`` and return its path.

    The pretraining script calls this after every ``save_pretrained``; see :func:`build_model_card`
    for the arguments. Results written later by the evaluation commands are picked up when the card
    is rendered again (``hf-lookaround push`` re-renders cards written by this function).
    """
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory: save the checkpoint (save_pretrained) before writing its card")
    card = build_model_card(folder, objective=objective, plan_params=plan_params, dataset=dataset, **kwargs)
    path = folder / "README.md"
    _write_text(path, str(card))
    return path


def _write_text(path: Path, text: str) -> None:
    # unlink first: in a staging folder the old file is a symlink into the user's checkpoint
    if path.is_symlink():
        path.unlink()
    path.write_text(text, encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Remote code
# ----------------------------------------------------------------------------------------------
def _package_module_files(model_module: str = MODEL_MODULE) -> list[Path]:
    """The modules a checkpoint needs for trust_remote_code, as transformers' custom_object_save copies them."""
    import importlib

    from transformers.dynamic_module_utils import get_relative_import_files

    model_file = Path(importlib.import_module(f"{__package__}.{model_module}").__file__)
    return [model_file] + [Path(f) for f in get_relative_import_files(model_file)]


def _remote_code_problems(folder: Path, modules: list[str]) -> list[str]:
    """Why the remote-code modules in ``folder`` would not load without the package (empty: they would)."""
    problems, seen, todo = [], set(), list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = folder / f"{name}.py"
        if not path.is_file():
            problems.append(f"{path.name} is missing")
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level > 1 or node.module is None:
                    # transformers follows only `from .module import x` when it fetches remote code
                    problems.append(
                        f"{path.name} line {node.lineno}: `from {'.' * node.level}{node.module or ''} import ...` is "
                        "not followed by transformers' remote-code loader; write `from .module import name`"
                    )
                else:
                    todo.append(node.module.split(".")[0])
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(n == "hf_lookaround" or n.startswith("hf_lookaround.") for n in names):
                    problems.append(
                        f"{path.name} line {node.lineno} imports hf_lookaround: users without the package cannot "
                        "run it; use a relative import (`from .module import name`)"
                    )
    return problems


def _defined_classes(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)}


def ensure_remote_code(folder) -> list[str]:
    """Make ``folder`` loadable with ``trust_remote_code=True`` by someone without this package.

    If ``configuration_lookaround.py`` / ``modeling_lookaround.py`` (and what they import) are not
    all there, the whole set is copied from the installed package, as ``save_pretrained`` does for a
    model registered with ``register_for_auto_class``. ``config.json["auto_map"]`` is completed so
    that every head (AutoModel, ...ForPreTraining, ...ForMaskedLM, ...ForCausalLM,
    ...ForSequenceClassification) resolves. Raises ValueError if the modules are not self-contained.
    Returns the names of the files written. Files in ``folder`` are replaced, never written through
    (symlinks are unlinked first).
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is missing or not valid JSON: save the model with save_pretrained first")
    if config.get("model_type") not in REMOTE_CODE:
        raise ValueError(
            f"{config_path} has model_type {config.get('model_type')!r}, not one of {sorted(REMOTE_CODE)}: this is "
            "not a LookAround checkpoint, so hf_lookaround cannot supply its remote code"
        )
    config_module, config_class, model_module, heads = REMOTE_CODE[config["model_type"]]
    written = []
    problems = _remote_code_problems(folder, [config_module, model_module])
    if problems:
        replaced = []
        for source in _package_module_files(model_module):
            target = folder / source.name
            if target.is_symlink() or target.exists():
                replaced.append(source.name)
                target.unlink()
            shutil.copyfile(source, target)
            written.append(source.name)
        if replaced:  # the checkpoint's own copy was incomplete: the package's may be a newer version
            logger.warning("replaced the checkpoint's remote code (%s) by the installed hf_lookaround's: %s",
                           "; ".join(problems), ", ".join(replaced))
        else:
            logger.info("added remote code from the installed hf_lookaround: %s", ", ".join(written))
    problems = _remote_code_problems(folder, [config_module, model_module])
    if problems:
        raise ValueError("the remote-code files cannot be loaded without hf_lookaround:\n  " + "\n  ".join(problems))

    classes = _defined_classes(folder / f"{model_module}.py")
    wanted = {"AutoConfig": f"{config_module}.{config_class}"}
    wanted.update({auto: f"{model_module}.{cls}" for auto, cls in heads.values() if cls in classes})
    auto_map = dict(config.get("auto_map") or {})
    if any(auto_map.get(k) != v for k, v in wanted.items()):
        config["auto_map"] = {**auto_map, **wanted}
        _write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    return written


# ----------------------------------------------------------------------------------------------
# Weights check
# ----------------------------------------------------------------------------------------------
WEIGHTS_NAME, WEIGHTS_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"


def _check_safetensors(path: Path, where: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = list(f.keys())
    except Exception as err:  # safetensors raises its own error type; name the file instead
        raise ValueError(
            f"{path.name} in {where} is not a valid safetensors file ({err}); it is truncated or corrupt. "
            f"Save the model again with save_pretrained and re-upload it (hf-lookaround push <dir> <repo>)."
        ) from None
    if not keys:
        raise ValueError(f"{path.name} in {where} holds no tensors; save the model again and re-upload it")


def check_weights(folder, where: str | None = None) -> list[Path]:
    """Check that ``folder`` holds safetensors weights (one file or an index and its shards) with valid headers.

    Returns the weight files; raises ValueError naming the missing or corrupt file otherwise.
    """
    folder = Path(folder)
    where = where or str(folder)
    index = folder / WEIGHTS_INDEX_NAME
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif index.is_file():
        data = _read_json(index)
        if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
            raise ValueError(f"{WEIGHTS_INDEX_NAME} in {where} is not a valid index (no weight_map); save the model again")
        files = [folder / name for name in sorted(set(data["weight_map"].values()))]
        for path in files:
            if not path.is_file():
                raise ValueError(f"{path.name}, listed in {WEIGHTS_INDEX_NAME}, is missing from {where}; upload it")
    else:
        pickled = [p.name for p in folder.glob("*.bin")]
        hint = (f" (found {', '.join(pickled)}: re-save with save_pretrained, which writes safetensors)"
                if pickled else "")
        raise ValueError(f"no weights in {where}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}{hint}")
    for path in files:
        _check_safetensors(path, where)
    return files


# ----------------------------------------------------------------------------------------------
# Push
# ----------------------------------------------------------------------------------------------
class HubPushError(RuntimeError):
    """A push failed; the local checkpoint is untouched and the push can simply be run again."""


def _files_to_push(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir()
        if p.is_file() and not any(fnmatch.fnmatch(p.name, pattern) for pattern in EXCLUDED_FILES)
    )


def _stage(folder: Path, staging: Path, repo_id: str, card_kwargs: dict | None) -> list[str]:
    """Fill ``staging`` with links to the checkpoint's files plus what is missing; returns what was generated."""
    for path in _files_to_push(folder):
        target = staging / path.name
        try:
            target.symlink_to(path.resolve())
        except OSError:  # no symlinks on this file system: copy
            shutil.copy2(path, target)
    generated = ensure_remote_code(staging)

    # Re-render the card if it is missing or ours (its arguments are in its metadata), with the repo id.
    readme = staging / "README.md"
    stored = None
    if readme.exists():
        from huggingface_hub import ModelCard

        try:
            stored = ModelCard.load(readme).data.to_dict().get(CARD_ARGS_KEY)
        except Exception:  # unparsable metadata: a hand-written card, uploaded as it is
            stored = None
    if not readme.exists() or stored is not None or card_kwargs:
        args = {**(stored or {}), **(card_kwargs or {}), "model_id": repo_id}
        write_model_card(staging, **args)
        generated.append("README.md")
    return generated


def push_checkpoint(
    checkpoint_dir,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    card_kwargs: dict | None = None,
):
    """Upload a checkpoint folder to the Hub repo ``repo_id`` (created if needed); returns the ``CommitInfo``.

    Uploads the safetensors weights, ``config.json``, tokenizer files, the model card and the
    remote-code modules (added from the installed package if the folder lacks them), with
    ``HfApi.create_repo`` + ``HfApi.upload_folder``. Optimizer/scheduler state and pickles are not
    uploaded. ``checkpoint_dir`` itself is never modified. ``endpoint`` defaults to ``HF_ENDPOINT``.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(checkpoint_dir)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a checkpoint: it has no config.json (save the model with save_pretrained)")
    if repo_id.count("/") > 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id must be 'name' or 'namespace/name', got {repo_id!r}")
    check_weights(folder)
    if constants.is_offline_mode():
        raise HubPushError("HF_HUB_OFFLINE is set, so nothing can be pushed: unset it (or set HF_HUB_OFFLINE=0)")

    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="hf_lookaround_push_") as tmp:
        staging = Path(tmp)
        generated = _stage(folder, staging, repo_id, card_kwargs)
        if generated:
            logger.info("generated for the upload (not written to %s): %s", folder, ", ".join(generated))
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True)
            return api.upload_folder(
                folder_path=staging,
                repo_id=url.repo_id,
                commit_message=commit_message or f"Upload {folder.name} with hf_lookaround",
                revision=revision,
            )
        except (HfHubHTTPError, *_transport_errors(), OSError) as err:  # OSError: connection errors, offline mode
            raise HubPushError(
                f"pushing {folder} to {repo_id} at {api.endpoint} failed: {err}\n"
                "The local checkpoint was not modified. Fix the cause (token, network, HF_ENDPOINT, server) "
                "and run the same push again; files already on the Hub are skipped."
            ) from err


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's own connection errors (httpx for huggingface_hub 1.x, if it is installed)."""
    try:
        import httpx
    except ImportError:
        return ()
    return (httpx.HTTPError,)


def push_trainer_output(trainer, repo_id: str | None = None, **card_kwargs):
    """What ``--push_to_hub`` calls at the end of pretraining, in place of ``trainer.push_to_hub()``.

    Saves the model and tokenizer to ``args.output_dir``, writes our model card there, and pushes
    the folder with :func:`push_checkpoint`, using the Trainer's hub arguments (``hub_model_id``,
    ``hub_token``, ``hub_private_repo``, ``hub_revision``). ``trainer.push_to_hub`` would replace our
    card by Trainer's generic one and upload an ``auto_map`` that names only the saved head.
    """
    args = trainer.args
    trainer.save_model(args.output_dir)
    if not trainer.is_world_process_zero():
        return None
    repo_id = repo_id or args.hub_model_id or Path(args.output_dir).name
    write_model_card(args.output_dir, **card_kwargs)
    return push_checkpoint(args.output_dir, repo_id, private=args.hub_private_repo, token=args.hub_token,
                           revision=getattr(args, "hub_revision", None))


# ----------------------------------------------------------------------------------------------
# Load (with the package)
# ----------------------------------------------------------------------------------------------
def _fetch_weights(repo_id: str, hub_kwargs: dict) -> Path:
    """Download the weights of ``repo_id`` (into the cache) and return the snapshot folder that holds them."""
    from huggingface_hub import hf_hub_download
    # only the server saying "no such file" counts as missing; offline cache misses keep their own error
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, WEIGHTS_NAME, **hub_kwargs)).parent
    except RemoteEntryNotFoundError:
        pass
    try:
        index = Path(hf_hub_download(repo_id, WEIGHTS_INDEX_NAME, **hub_kwargs))
    except RemoteEntryNotFoundError:
        raise ValueError(
            f"no weights in the Hub repo {repo_id}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}. "
            f"Push the checkpoint again (hf-lookaround push <checkpoint_dir> {repo_id})."
        ) from None
    data = _read_json(index) or {}
    for shard in sorted(set((data.get("weight_map") or {}).values())):
        try:
            hf_hub_download(repo_id, shard, **hub_kwargs)
        except RemoteEntryNotFoundError:
            raise ValueError(f"{shard}, listed in {WEIGHTS_INDEX_NAME}, is missing from the Hub repo {repo_id}; "
                             "push the checkpoint again") from None
    return index.parent


def load_pretrained(repo_or_dir, head: str = "base", **kwargs):
    """Load a LookAround checkpoint (local folder or Hub repo id) into ``head`` with the package's classes.

    ``head`` is one of :data:`HEADS` (base, pretraining, masked-lm, causal-lm, sequence-classification).
    The weights are checked first (present, valid safetensors), so a broken checkpoint fails with a
    ValueError that names the file; ``kwargs`` go to ``from_pretrained`` (``revision``, ``cache_dir``,
    ``token`` and ``local_files_only`` also to the download).
    """
    import transformers

    import hf_lookaround  # noqa: F401  (importing the package registers the LookAround Auto classes)

    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {sorted(HEADS)}")
    path = Path(repo_or_dir)
    if path.is_dir():
        check_weights(path)
    else:
        hub_kwargs = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
        snapshot = _fetch_weights(str(repo_or_dir), hub_kwargs)
        check_weights(snapshot, where=f"the Hub repo {repo_or_dir} (cached in {snapshot})")
    auto_class = getattr(transformers, HEADS[head][0])
    return auto_class.from_pretrained(repo_or_dir, **kwargs)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround push",
        description="Push a checkpoint folder (safetensors weights, config, tokenizer, model card and the "
        "remote code that lets users load it without this package) to a Hub model repo. The local folder "
        "is not modified. The endpoint is HF_ENDPOINT (default https://huggingface.co).",
    )
    parser.add_argument("checkpoint_dir", help="a folder written by save_pretrained / Trainer.save_model")
    parser.add_argument("repo_id", help="'namespace/name' (or 'name' for your own namespace)")
    parser.add_argument("--private", action="store_true", help="create the repo private (ignored if it exists)")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login)")
    parser.add_argument("--commit-message", "--commit_message", dest="commit_message", default=None)
    parser.add_argument("--revision", default=None, help="branch to push to (default: main)")
    parser.add_argument("--dataset", default=None, help="pretraining data named in the card (if it is re-rendered)")
    args = parser.parse_args(argv)

    card_kwargs = {"dataset": args.dataset} if args.dataset else None
    try:
        info = push_checkpoint(args.checkpoint_dir, args.repo_id, private=args.private or None, token=args.token,
                               commit_message=args.commit_message, revision=args.revision, card_kwargs=card_kwargs)
    except (ValueError, HubPushError) as err:
        print(f"error: {err}")
        return 1
    print(f"pushed {args.checkpoint_dir} -> {info.commit_url}")
    print(f"load it with: AutoModel.from_pretrained({args.repo_id!r}, trust_remote_code=True)")
    return 0
