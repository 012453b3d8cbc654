"""Model cards: ``README.md`` next to a checkpoint, with what it is, how it was trained and its results.

- :func:`write_model_card` renders ``README.md`` next to a checkpoint from the templates in
  ``hf_lookaround/cards`` (one per model family) through ``huggingface_hub.ModelCard``, with the
  results that the evaluation commands left in the folder (:func:`collect_results`).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
from pathlib import Path

from .. import objectives
from .files import read_json, write_text
from .remote_code import HEADS, VIT_HEADS
from .results import collect_results_by_file, public_dataset_name

logger = logging.getLogger(__name__)

CARD_DIR = Path(__file__).resolve().parent.parent / "cards"
# text: a (semi-)autoregressive, any-order or mixture model; classifier: a fine-tune (`hf-lookaround glue`).
# "two-stream" is the text template's old name, kept so that a card rendered before re-renders at a push.
CARD_TEMPLATES = {"text": "text.md", "masked": "masked.md", "vision": "vision.md", "classifier": "classifier.md",
                  "two-stream": "text.md"}

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

# The card's load snippets name the repo; before a push the checkpoint has none yet, and its folder is what loads it
# (a push renders the card again with the repo id).
# Metadata key holding the arguments a card was rendered with, so that a push can re-render it.
CARD_ARGS_KEY = "hf_lookaround"

def model_family(config: dict, objective: str | None = None) -> str:
    """``"text"``, ``"masked"`` or ``"vision"``: which card template describes a pretrained checkpoint (a
    fine-tuned classifier's card is ``"classifier"``, chosen by its ``fine_tune`` argument)."""
    if config.get("modality") == "vision" or "patch_size" in config or "image_size" in config:
        return "vision"
    objective = objective or config.get("objective")
    if objective in objectives.OBJECTIVES:
        return objectives.OBJECTIVES[objective].card_template
    # no objective recorded: the attention pattern tells how the model was meant to be used
    return "masked" if config.get("default_attention") == "bidirectional" else "text"


def checkpoint_form(config: dict) -> dict:
    """What a text checkpoint's config says it is, for its card: ``tag`` (``"two-stream"`` or ``"one-stream"``),
    ``name`` (the card's words for it) and ``how`` (how its heads read it, and how many tokens ``generate()``
    decodes per forward). ``prediction_stream`` is the stream the run trained to predict; a one-stream checkpoint's
    ``default_attention`` is the pattern it trained with (block-causal: dar's SAT form, ``attention_group_size``
    tokens per group)."""
    attention, t = config.get("default_attention"), config.get("attention_group_size") or 1
    fields = f'`prediction_stream: "content"`, `default_attention: "{attention}"`'
    if config.get("prediction_stream") != "content":
        return {"tag": "two-stream", "one_stream": False,
                "name": "two-stream masked text model" if attention == "bidirectional" else "two-stream text model"}
    block = f"{fields}, `attention_group_size: {t}`"
    per_forward = f"{t} token{'s' if t != 1 else ''} per forward"
    if config.get("objective") == "mixture":
        return {"tag": "one-stream", "one_stream": True,
                "name": f"one-stream mixture text model (dar rows block-causal with t = {t}, masked rows over "
                        "`[MASK]` inputs)",
                "how": f"This checkpoint was trained one-stream ({block}): one row per token, dar's rows in SAT's "
                       f"block-causal form and the masked component's rows bidirectional over `[MASK]` inputs, with "
                       f"one LM head. `AutoModelForCausalLM` reads the dar half: `generate()` decodes {per_forward} "
                       "(`group_size` may only be its t). `AutoModelForMaskedLM` and the `fill-mask` pipeline read "
                       "the masked half (bidirectional, `[MASK]` inputs); `hf-lookaround perplexity --protocol "
                       "masked` scores it."}
    if attention == "block_causal":
        return {"tag": "one-stream", "one_stream": True,
                "name": f"one-stream semi-autoregressive text model (SAT, block-causal, t = {t})",
                "how": f"This checkpoint was trained one-stream in SAT's form ({block}): a token sees its own group "
                       f"of {t} and every earlier one, and the row {t} places before a token predicts it. `generate()` "
                       f"decodes {per_forward} (`group_size` may only be its t); the plain forward lays the input "
                       f"out {t} times and gives next-token logits, so the causal LM loss and lm-evaluation-harness "
                       "read it as any causal LM."}
    if attention == "block_diffusion":
        return {"tag": "one-stream", "one_stream": True,
                "name": f"one-stream block diffusion text model (BD3-LM's x_t ⊕ x_0, blocks of {t})",
                "how": f"This checkpoint was trained one-stream in BD3-LM's vectorised form ({block}): the input is "
                       "the noised sequence then the clean one; a noised block sees itself and the clean blocks "
                       "before it. `AutoModelForCausalLM`'s `generate(diffusion_threshold=...)` decodes it block by "
                       "block; `hf-lookaround perplexity --protocol elbo` scores it. It has no causal LM view."}
    if attention == "causal":
        return {"tag": "one-stream", "one_stream": True, "name": "one-stream causal text model (GPT-style)",
                "how": f"This checkpoint was trained one-stream ({fields}): `generate()` and the causal LM loss run "
                       "its causal content stream, one token per forward."}
    return {"tag": "one-stream", "one_stream": True, "name": "one-stream masked text model (BERT-style `[MASK]` inputs)",
            "how": f"This checkpoint was trained one-stream with `[MASK]` inputs ({fields}): `AutoModelForMaskedLM` "
                   "and the `fill-mask` pipeline read its bidirectional content stream."}


def public_model_id(name: str | None) -> str | None:
    """A base model as a card names it: its Hub id, or ``"local"`` for a folder of this machine (a path is no
    link, and this machine's folders are not the card's business)."""
    if not name:
        return None
    name = str(name)
    if os.path.exists(name) or os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 \
            or " " in name:
        return "local"
    return name


def _default_plan_params(objective: str | None) -> dict:
    """The parameters :func:`objectives.make_plan` uses for ``objective`` when none are given."""
    return objectives.default_plan_params(objective)


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


def _in_words(items: list[str]) -> str:
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _training_summary(folder: Path) -> dict:
    state = read_json(folder / "trainer_state.json") or {}
    return {k: state[k] for k in ("global_step", "epoch") if k in state}


_PIPELINE_TAGS = {"text": "text-generation", "two-stream": "text-generation", "masked": "fill-mask",
                  "classifier": "text-classification", "vision": "image-feature-extraction"}


def _objective_and_family(config: dict, objective: str | None, family: str | None, fine_tune: dict | None):
    """The card's objective (given, else the config's) and template family (given, else what the checkpoint is),
    both checked."""
    objective = objective or config.get("objective")
    if objective is not None and objective not in objectives.OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {sorted(objectives.OBJECTIVES)} (or leave it None)")
    family = family or ("classifier" if fine_tune else model_family(config, objective))
    if family not in CARD_TEMPLATES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(CARD_TEMPLATES)}")
    return objective, family


def _plan_rows(given: dict, objective: str | None) -> list[tuple]:
    """The plan's parameters as table rows: those given, then the defaults the plan fills in (marked so)."""
    defaults = _default_plan_params(objective)
    return [(k, given[k], "") for k in sorted(given)] + [
        (k, v, "default") for k, v in sorted(defaults.items()) if k not in given
    ]


def _card_datasets(dataset: str | list[str] | None):
    """The pretraining data as the card names it: the Hub ids for the metadata, the public names, and ``dataset``
    in the shape it was given (one name or a list)."""
    datasets = [dataset] if isinstance(dataset, str) else list(dataset or [])
    # The Hub's `datasets` metadata takes dataset ids; a local path would be a broken link.
    # ("name:config" is how the pretraining script names a datasets config)
    hub_datasets = [d.split(":")[0] for d in datasets if d.count("/") <= 1 and not os.path.exists(d) and " " not in d]
    # everything else the card says of its data, by name: never a path of this machine
    datasets = [public_dataset_name(d) for d in datasets]
    return hub_datasets, datasets, datasets if not isinstance(dataset, str) else datasets[0]


def _public_fine_tune(fine_tune: dict | None) -> dict | None:
    """A fine-tune's description with its data sets by public name."""
    if fine_tune:
        fine_tune = {k: public_dataset_name(v) if k.endswith("dataset") and v else v for k, v in fine_tune.items()}
    return fine_tune


def _objective_text(objective: str | None, given: dict):
    """The objective's title and the card's description of its plan (``None`` for a checkpoint without one)."""
    entry = objectives.OBJECTIVES.get(objective)
    return (entry.title, objectives.card_text(objective, given)) if entry else (None, None)


def _results(folder: Path, dataset: str | None, family: str, tag: str, fine_tune: dict | None):
    """The results the evaluation commands left in ``folder``: by file, and all of them in one list."""
    by_file = collect_results_by_file(folder, dataset=dataset,
                                      task_type=tag if family != "vision" else "image-classification",
                                      fine_tune=fine_tune)
    return by_file, [r for found in by_file.values() for r in found]


def _rerender_args(**args) -> dict:
    """The arguments a card was rendered with (those set), kept in its metadata so that a push can re-render it."""
    # copies: an object met twice (the language list) would be written as a YAML anchor (&id001) and alias
    return {k: copy.deepcopy(v) for k, v in args.items() if v}


def _card_data(card_args: dict, *, tag, form, family, objective, tags, hub_datasets, base_model, model_id,
               eval_results, language, license):
    """The card's YAML metadata."""
    from huggingface_hub import ModelCardData

    return ModelCardData(
        language=language,
        license=license,
        library_name="transformers",
        pipeline_tag=tag,
        # the form (two- or one-stream) and the family, never a template's name that says another form
        tags=sorted({"hf_lookaround", "lookaround", "custom_code", *([form["tag"]] if form["tag"] else []),
                     *([family] if family in ("masked", "vision", "classifier") else []), *(tags or []),
                     *([objective] if objective else [])}),
        datasets=hub_datasets or None,
        base_model=base_model if base_model != "local" else None,  # the Hub links a base_model: a local one is none
        model_name=model_id if eval_results else None,
        eval_results=eval_results or None,
        **{CARD_ARGS_KEY: card_args},
    )


def _architecture(config: dict) -> dict:
    return {k: config[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
        "max_position_embeddings", "hidden_act", "norm_type", "position_embedding_type", "default_attention",
        "prediction_stream",
    ) if k in config}


def _result_rows(eval_results: list) -> list[dict]:
    # `|` would end a markdown table cell
    return [
        {k: str(v).replace("|", "\\|") for k, v in dict(
            task=r.task_name, dataset=r.dataset_name, split=r.dataset_split or "", metric=r.metric_name,
            value=f"{r.metric_value:.4g}").items()}
        for r in eval_results
    ]


def _decoding_snippets(config: dict) -> dict:
    """Which load snippets a masked checkpoint's card shows: ``fill_mask`` (its plain forward reads ``[MASK]``
    inputs; BD3-LM's one-stream form reads ``x_t ⊕ x_0`` only) and ``diffusion_decoding`` (``generate()`` decodes
    it: :func:`decodes_by_diffusion`)."""
    from types import SimpleNamespace

    from ..models.lookaround.diffusion_lookaround import decodes_by_diffusion, is_block_diffusion_model

    as_config = SimpleNamespace(**config)
    return {"fill_mask": not is_block_diffusion_model(as_config), "diffusion_decoding": decodes_by_diffusion(as_config)}


def _pipeline_tag(family: str, snippets: dict) -> str:
    # BD3-LM's one-stream form fills no masks by itself: the Hub's widget would fail; generate() is what it does
    return "text-generation" if family == "masked" and not snippets["fill_mask"] else _PIPELINE_TAGS[family]


def build_model_card(
    checkpoint_dir,
    objective: str | None = None,
    plan_params: dict | None = None,
    dataset: str | list[str] | None = None,
    dataset_description: str | None = None,
    model_id: str | None = None,
    family: str | None = None,
    license: str | None = None,
    language: str | list[str] | None = None,
    base_model: str | None = None,
    tags: list[str] | None = None,
    eval_dataset: str | None = None,
    pipeline_tag: str | None = None,
    fine_tune: dict | None = None,
):
    """Render the card of the checkpoint in ``checkpoint_dir`` and return a ``huggingface_hub.ModelCard``.

    ``objective`` / ``plan_params`` default to the ``objective`` / ``plan_params`` fields of
    ``config.json``; parameters not given are filled with the defaults of :mod:`hf_lookaround.plans`
    (and marked so). ``dataset`` names the pretraining data (a Hub dataset id goes into the metadata;
    a local name or path is only described); ``eval_dataset`` the data the ``eval_*`` results were measured on
    (the validation files, or the held-out part of the training data). ``model_id`` is the repo id used in
    the load snippets (default: the checkpoint's folder, which is what loads it before a push).
    ``license`` and ``language`` are left out of the metadata unless given: nothing here knows them.
    ``pipeline_tag`` overrides the family's. ``base_model``: a Hub id, or a local folder (named ``"local"``).
    ``fine_tune`` makes it the card of a fine-tuned classifier (family ``"classifier"``): ``{"task", "method"
    ("full" or "LoRA r=.. alpha=.."), "dataset", "eval_dataset", "test_dataset", "problem_type", "labels"}``; its
    results are the fine-tune's (validation and test), and ``objective`` is the base model's pretraining objective.
    """
    from huggingface_hub import ModelCard

    folder = Path(checkpoint_dir)
    config = read_json(folder / "config.json") or {}
    objective, family = _objective_and_family(config, objective, family, fine_tune)
    given = dict(plan_params if plan_params is not None else config.get("plan_params") or {})
    hub_datasets, datasets, dataset = _card_datasets(dataset)
    eval_dataset = public_dataset_name(eval_dataset) if eval_dataset else eval_dataset
    model_id = model_id or str(checkpoint_dir)
    base_model = public_model_id(base_model)
    fine_tune = _public_fine_tune(fine_tune)
    snippets = _decoding_snippets(config)
    tag = pipeline_tag or _pipeline_tag(family, snippets)
    by_file, eval_results = _results(folder, eval_dataset or ", ".join(datasets) or None, family, tag, fine_tune)
    form = checkpoint_form(config) if family != "vision" else {"tag": None, "one_stream": False}

    card_args = _rerender_args(
        objective=objective, plan_params=given or None, dataset=dataset or None,
        dataset_description=dataset_description, family=family, eval_dataset=eval_dataset, license=license,
        language=language, base_model=base_model, pipeline_tag=pipeline_tag, fine_tune=fine_tune)
    card_data = _card_data(card_args, tag=tag, form=form, family=family, objective=objective, tags=tags,
                           hub_datasets=hub_datasets, base_model=base_model, model_id=model_id,
                           eval_results=eval_results, language=language, license=license)
    name, plan_text = _objective_text(objective, given)
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_DIR / CARD_TEMPLATES[family]),
        model_id=model_id,
        family=family,
        form=form,
        base_model=base_model,
        fine_tune=fine_tune or {},
        objective=objective,
        objective_name=name,
        plan_description=plan_text,
        plan_rows=_plan_rows(given, objective),
        datasets=datasets,
        dataset_description=dataset_description,
        architecture=_architecture(config),
        num_parameters=_human(_num_parameters(folder)),
        training=_training_summary(folder),
        results=_result_rows(eval_results),
        result_sources=_in_words([f"`{name}`" for name in by_file]),  # only the files that hold a result
        plan_kwargs="".join(f", {k}={v!r}" for k, v in sorted(given.items())),
        # text protocols for text models; a vision model is probed, fine-tuned and scored on reconstruction
        protocols=VISION_PROTOCOLS if family == "vision" else EVALUATION_PROTOCOLS,
        heads=[(head, auto) for head, (auto, _) in (VIT_HEADS if family == "vision" else HEADS).items()],
        citation=CITATION,
        **snippets,
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
    write_text(path, str(card))
    return path
