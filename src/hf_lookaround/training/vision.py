"""Pretrain the two-stream ViT on an image data set and evaluate it (``hf-lookaround vision``): reconstruction L2,
linear probes and (optionally) fine-tuning, each written to ``vision_results.json`` as soon as it is measured."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import objectives
from ..hub.cards import write_model_card
from ..models.lookaround.configuration_lookaround_vit import LookAroundViTConfig
from ..data.image_collator import make_image_collator
from ..data.images import (
    BUILTIN_GEOMETRY,
    ImageDataset,
    ImageSource,
    fit_image_processor,
    load_image_splits,
    pixel_values_of,
)
from ..evaluation.image_probing import linear_probe_images, no_class_labels
from ..evaluation.reconstruction import MeanPatchPredictor, reconstruction_l2, uses_codebook
from ..models.lookaround.modeling_lookaround_vit import (
    LookAroundViTForImageClassification,
    LookAroundViTForPreTraining,
)

logger = logging.getLogger(__name__)



def _plan_params(args) -> dict:
    """The plan's parameters from the options the objective's module names (``--num_groups``, ``--mask_ratio``...)."""
    objective = objectives.get(args.objective)
    return objective.Params(**{f: getattr(args, f) for f in objective.flags if hasattr(args, f)}).plan_params()


def _training_args(output_dir, args, steps):
    from transformers import TrainingArguments

    from .pretraining import pin_memory_useful

    return TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20), logging_steps=max(1, steps // 10), save_strategy="no",
        report_to="none", seed=args.seed, dataloader_num_workers=args.dataloader_num_workers,
        remove_unused_columns=False, disable_tqdm=True, bf16=args.bf16,
        dataloader_pin_memory=pin_memory_useful(False),
    )


def _finetune(model, args, images, labels, test_images, test_labels, output_dir) -> float:
    from transformers import Trainer

    model.set_attn_implementation(args.attn_implementation)
    no_class = -1 if no_class_labels(model.config, 1, "cpu") else None
    Trainer(model=model, args=_training_args(output_dir, args, args.finetune_steps),
            train_dataset=ImageDataset(images, labels, class_labels=no_class)).train()
    model.eval()
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = torch.cat([model(pixel_values=test_images[i : i + 256].to(device),
                                  **no_class_labels(model.config, len(test_images[i : i + 256]), device)).logits.float().cpu()
                            for i in range(0, len(test_images), 256)])
    return float((logits.argmax(-1) == test_labels).float().mean())


def _geometry(args, train: ImageSource) -> tuple[int, int]:
    default_size, default_patch = BUILTIN_GEOMETRY.get(args.dataset, (train.image_size, 4))
    image_size = args.image_size or default_size
    patch_size = args.patch_size or default_patch
    if image_size < 1 or patch_size < 1:
        raise ValueError(f"--image_size and --patch_size must be positive, got {image_size} and {patch_size}")
    if image_size % patch_size:
        divisors = [d for d in range(1, image_size + 1) if image_size % d == 0]
        raise ValueError(f"--patch_size {patch_size} does not divide the image size {image_size}: choose a patch size "
                         f"in {divisors}, or resize the images with --image_size")
    return image_size, patch_size


def _fit_codebook(model, images, args) -> dict:
    from ..data import visual_tokenizer

    subset = images[: args.codebook_images]  # on the CPU: k-means runs in scikit-learn
    start = time.perf_counter()
    patch_size = model.config.patch_size
    codebook = visual_tokenizer.fit_codebook(subset, patch_size, args.codebook_size, seed=args.seed)
    pixel_decoder = None
    if hasattr(visual_tokenizer, "fit_pixel_decoder"):  # the pixels each id decodes to, for sampling
        pixel_decoder = visual_tokenizer.fit_pixel_decoder(subset, codebook, patch_size)
    model.set_visual_codebook(torch.as_tensor(codebook).cpu(),
                              None if pixel_decoder is None else torch.as_tensor(pixel_decoder).cpu())
    return {"codebook_size": args.codebook_size, "fit_images": len(subset),
            "seconds": round(time.perf_counter() - start, 1)}


@dataclass
class _Images:
    """The images of a run, as pixel values of the fitted processor, with their class ids."""

    processor: object
    image_size: int
    patch_size: int
    label_names: tuple
    notes: object
    pretrain: torch.Tensor  # pretraining images, and their labels (condition tokens)
    pretrain_labels: torch.Tensor
    probe: torch.Tensor  # train images the pretraining did not see: probes and fine-tuning
    probe_labels: torch.Tensor
    test: torch.Tensor
    test_labels: torch.Tensor


def run(args) -> dict:
    """Pretrain, save (model and image processor), then measure; ``args`` as ``hf-lookaround vision`` parses them.
    Returns the results, also written to ``OUTPUT_DIR/vision_results.json`` after every stage.

    The steps, in order: read and split the images (:func:`_load_images`), build the config and the collator from
    the objective's plan flags, pretrain with ``Trainer`` and save, then measure stage by stage
    (:func:`_measure`)."""
    from transformers import Trainer, set_seed

    from .pretraining import CollatorEpochCallback

    started = time.perf_counter()
    out = Path(args.output_dir)
    set_seed(args.seed)
    images = _load_images(args)
    params = _plan_params(args)
    sizes = {k: getattr(args, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size")}
    if args.preset:
        from ..models.lookaround.configuration_lookaround import PRESETS

        sizes = dict(PRESETS[args.preset])
    num_labels = len(images.label_names)
    config = LookAroundViTConfig(
        image_size=images.image_size, patch_size=images.patch_size, num_channels=images.processor.num_channels,
        **sizes, position_embedding_type=args.position_embedding_type, norm_pix_loss=args.norm_pix_loss,
        objective=args.objective, plan_params=params, target_mode=args.target_mode,
        codebook_size=args.codebook_size,
        num_condition_tokens=1 if args.class_conditional else 0,
        num_condition_classes=num_labels if args.class_conditional else 0,
        num_labels=num_labels, id2label=dict(enumerate(images.label_names)),
    )
    out.mkdir(parents=True, exist_ok=True)
    collator = make_image_collator(args.objective, config.num_patches, seed=args.seed,
                                   num_prefix_tokens=config.num_prefix_tokens,
                                   class_conditional=args.class_conditional, class_dropout=args.class_dropout,
                                   **params)
    model = LookAroundViTForPreTraining(config)
    model.set_attn_implementation(args.attn_implementation)
    processor = images.processor
    results = {
        "dataset": {"name": args.dataset, "image_size": images.image_size, "patch_size": images.patch_size,
                    "num_channels": processor.num_channels, "image_mean": list(processor.image_mean),
                    "image_std": list(processor.image_std), "num_classes": num_labels,
                    "notes": images.notes},
        "objective": args.objective, "target_mode": args.target_mode, "class_conditional": args.class_conditional,
        "plan_params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
        "num_parameters": model.num_parameters(), "num_pretrain_images": len(images.pretrain),
        "num_probe_images": len(images.probe), "num_test_images": len(images.test),
        "max_steps": args.max_steps, "seconds": {"data": round(time.perf_counter() - started, 1)},
    }
    if uses_codebook(config):
        results["codebook"] = _fit_codebook(model, images.pretrain, args)
        results["seconds"]["codebook"] = results["codebook"]["seconds"]
    scratch = LookAroundViTForPreTraining(config)  # the same initialisation scheme, never trained
    trainer = Trainer(model=model, args=_training_args(out / "trainer", args, args.max_steps),
                      train_dataset=ImageDataset(images.pretrain,
                                                 images.pretrain_labels if args.class_conditional else None),
                      data_collator=collator, callbacks=[CollatorEpochCallback(collator)])
    train_result = trainer.train()
    model.save_pretrained(out)
    processor.save_pretrained(out)  # AutoImageProcessor.from_pretrained(out) gives the same pixel_values
    results["train_loss"] = train_result.training_loss
    results["seconds"]["pretraining"] = train_result.metrics.get("train_runtime")
    _measure(results, model, scratch, images, params, args)
    write_model_card(out, dataset=str(args.dataset))  # the measurements are in vision_results.json beside it
    return results


def _load_images(args) -> _Images:
    """Read the data set, check the split sizes against it, shuffle (seeded) and split the train images into
    pretraining and probe images, and fit the image processor on them."""
    from ..data.subsets import seeded_sample

    train_source, test_source = load_image_splits(args.dataset, args.data, args.image_column, args.label_column,
                                                  args.test_fraction, args.seed)
    if train_source.labels is None or test_source.labels is None:
        raise ValueError(f"{args.dataset!r} has no label column: name it with --label_column (the probes, "
                         f"fine-tuning and class condition tokens need one class per image)")
    image_size, patch_size = _geometry(args, train_source)
    n_probe = args.num_probe_train
    n_pre = len(train_source) - n_probe if args.num_train is None else args.num_train
    if n_probe < 2 or n_pre < 1 or n_pre + n_probe > len(train_source):
        raise ValueError(f"the train split of {args.dataset!r} has {len(train_source)} images: --num_train ({n_pre}) "
                         f"+ --num_probe_train ({n_probe}) must fit in it, with at least 1 and 2 images")
    if args.num_test is not None and not 1 <= args.num_test <= len(test_source):
        raise ValueError(f"--num_test must lie in [1, {len(test_source)}] (the test split's size), got {args.num_test}")
    # shuffled (seeded) before slicing: the pretraining, probe and test images of a class-sorted folder would
    # otherwise be a few classes each (a probe then scores 0)
    train_source = train_source.shuffled(args.seed).select(0, n_pre + n_probe)
    test_source = seeded_sample(test_source, args.num_test, args.seed, what="test images", flag="--num_test")
    processor, train_pixels = fit_image_processor(train_source, image_size)
    test_images = pixel_values_of(test_source, processor)
    train_labels = torch.from_numpy(train_source.labels)
    test_labels = torch.from_numpy(test_source.labels)
    label_names = train_source.label_names or tuple(str(i) for i in range(int(train_labels.max()) + 1))
    num_labels = len(label_names)
    if int(max(train_labels.max(), test_labels.max())) >= num_labels:
        raise ValueError(f"class ids reach {int(max(train_labels.max(), test_labels.max()))} but the data set names "
                         f"{num_labels} classes")
    # the probe (and fine-tuning) uses train images the pretraining did not see
    probe_labels = train_labels[n_pre:]
    if len(set(probe_labels.tolist())) < 2:
        raise ValueError(f"the {n_probe} probe images hold a single class; raise --num_probe_train")
    for what, part in (("--num_probe_train", probe_labels), ("--num_test", test_labels)):
        missing = sorted(set(range(num_labels)) - set(part.tolist()))
        if missing:
            logger.warning("the images kept by %s hold no image of %d class(es) (%s): their accuracy cannot be "
                           "measured; raise %s", what, len(missing), [label_names[i] for i in missing][:10], what)
    return _Images(processor=processor, image_size=image_size, patch_size=patch_size, label_names=label_names,
                   notes=train_source.notes, pretrain=train_pixels[:n_pre], pretrain_labels=train_labels[:n_pre],
                   probe=train_pixels[n_pre:], probe_labels=probe_labels, test=test_images, test_labels=test_labels)


def _measure(results: dict, model, scratch, images: _Images, params: dict, args) -> None:
    """Reconstruction L2, linear probes and (``--finetune_steps``) fine-tuning, each stage written to
    ``vision_results.json`` as soon as it is measured, so a run stopped part-way keeps what it measured."""
    out = Path(args.output_dir)
    path = out / "vision_results.json"
    config = model.config

    def stage(name, compute):
        start = time.perf_counter()
        results[name] = compute()
        results["seconds"][name] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(results, indent=2))
        logger.info("%s: %s", name, json.dumps(results[name])[:400])

    # reconstruction: the same plans (seeded) in both modes; predicting the mean training patch is the baseline
    def reconstruct():
        pixel_model = not (args.norm_pix_loss or uses_codebook(config))
        modes = ("teacher_forced", "generative") if pixel_model and not args.no_generative else ("teacher_forced",)
        recon = {mode: reconstruction_l2(model, images.test, objective=args.objective, plan_params=params,
                                         mode=mode, seed=args.seed) for mode in modes}
        recon["mean_image_baseline"] = reconstruction_l2(MeanPatchPredictor(model, images.pretrain), images.test,
                                                         objective=args.objective, plan_params=params, seed=args.seed)
        return recon

    stage("reconstruction_l2", reconstruct)
    # probes: pretrained features, the same architecture untrained, raw pixels
    probed = (("pretrained", model),) if args.no_baselines else (
        ("pretrained", model), ("random_init", scratch.to(model.device)), ("raw_pixels", None))
    stage("linear_probe", lambda: {
        name: linear_probe_images(m, images.probe, images.probe_labels, images.test, images.test_labels,
                                  seed=args.seed, backend=args.probe_backend)["test_accuracy"]
        for name, m in probed
    })
    if args.finetune_steps:
        stage("finetune_test_accuracy", lambda: _finetune_and_save(images, args))


def _finetune_and_save(images: _Images, args) -> dict:
    """Fine-tune the pretrained model (and, unless ``--no_baselines``, one from scratch) on the probe images; the
    pretrained one is saved pipeline-ready in ``OUTPUT_DIR/classifier`` with the image processor and a card."""
    out = Path(args.output_dir)
    classifier = LookAroundViTForImageClassification.from_pretrained(out)
    accuracy = _finetune(classifier, args, images.probe, images.probe_labels, images.test, images.test_labels,
                         out / "ft")
    # a pipeline-ready classifier: weights, config (id2label) and the image processor side by side
    classifier.save_pretrained(out / "classifier")
    images.processor.save_pretrained(out / "classifier")
    write_model_card(out / "classifier", dataset=str(args.dataset), base_model=str(out),
                     pipeline_tag="image-classification")
    if args.no_baselines:
        return {"pretrained": accuracy}
    scratch_classifier = LookAroundViTForImageClassification(LookAroundViTConfig.from_pretrained(out))
    return {"pretrained": accuracy,
            "from_scratch": _finetune(scratch_classifier, args, images.probe, images.probe_labels, images.test,
                                      images.test_labels, out / "ft_scratch")}
