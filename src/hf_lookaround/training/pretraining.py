"""Pretraining with ``Trainer``: ``hf-lookaround pretrain`` and ``examples/run_pretraining.py``.

Arguments are parsed with ``HfArgumentParser`` into :class:`ModelArguments`, :class:`DataArguments`,
:class:`ObjectiveArguments` and transformers' ``TrainingArguments``, so every Trainer option
(``--output_dir``, ``--max_steps``, ``--push_to_hub``, ``--resume_from_checkpoint``, ...) works,
and so does ``accelerate launch``. A single ``.json`` argument is read as a file of arguments.

The pipeline:

1. load the text with ``datasets`` (local files/folders or a Hub name; an ``IterableDataset`` with
   ``--streaming``) and hold out validation documents;
2. load a tokenizer (directory or hub name) or train one on the training text;
3. build the model: two-stream objectives train ``LookAroundForPreTraining``; the single-stream
   masked form trains ``LookAroundForMaskedLM``. The objective and the plan's parameters are stored
   in ``config.objective`` / ``config.plan_params`` (the keyword arguments of ``objectives.make_plan``),
   and ``config.default_attention`` is ``causal`` for ar/dar and ``bidirectional`` otherwise;
4. tokenize and pack the text into BOS-prefixed blocks (cached ``.map`` calls, :mod:`hf_lookaround.data.text`)
   and train with the objective's collator. Evaluation reports
   ``eval_loss`` and ``eval_objective_perplexity = exp(eval_loss)`` (the perplexity *of the
   objective*, which differs between objectives); at the end, if ``do_eval``, the protocol of
   :mod:`hf_lookaround.evaluation.perplexity` gives ``p(x_k | x_<k)`` on validation documents,
   comparable across objectives (``eval_ar_perplexity`` or ``eval_masked_perplexity``).

Mask tokens: the two-stream masked form never feeds ``[MASK]`` (the query stream has no access to
the masked token), so it does not need one; only ``--masked_form single_stream`` requires the
tokenizer to have a mask token.
"""

from __future__ import annotations

import json
import logging
import math
import os
import dataclasses
import shutil
import typing
from dataclasses import dataclass, field
from pathlib import Path

from transformers import (
    AutoConfig,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import objectives
from ..data.collators import PlanCollator
from ..data.subsets import seeded_sample
from ..data.tokenization import auto_tokenizer
from ..data.text import (
    build_blocks,
    is_split_by_node,
    iter_dataset_texts,
    load_text_dataset,
    rank_local_prepare,
    split_for_rank,
)
from ..decoding import is_block_diffusion_model, is_one_stream_group_model
from . import checkpointing
from ..hub.files import load_json_file
from .divergence import FiniteTrainingGuard

logger = logging.getLogger(__name__)

__all__ = [
    "ModelArguments",
    "DataArguments",
    "ObjectiveArguments",
    "LookAroundTrainingArguments",
    "gradient_accumulation_for",
    "LookAroundTrainer",
    "CollatorEpochCallback",
    "build_trainer",
    "run",
]

@dataclass
class ModelArguments:
    preset: str = field(default="small", metadata={"help": "size preset: tiny, mini, small, base, large"})
    config_name: str | None = field(default=None, metadata={"help": "a config.json (or a folder holding one) instead of a preset"})
    config_overrides: str | None = field(
        default=None, metadata={"help": "comma-separated key=value over the config, e.g. 'hidden_size=128,num_hidden_layers=2'"}
    )
    model_name_or_path: str | None = field(default=None, metadata={"help": "continue pretraining from this checkpoint"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer folder or hub name"})
    train_tokenizer: bool = field(default=False, metadata={"help": "train a byte-level BPE on the training text"})
    tokenizer_vocab_size: int = field(default=8192, metadata={"help": "vocabulary of a trained tokenizer"})
    tokenizer_max_documents: int | None = field(
        default=None, metadata={"help": "--train_tokenizer: read at most this many training documents (all by default)"}
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "eager, sdpa or flex_attention"})
    # adaptation (docs/adaptation.md): start from a pretrained causal LM, fully or with LoRA
    init_from: str | None = field(default=None, metadata={
        "help": "start from this folder: a causal LM (llama, mistral, qwen2, qwen3, gpt2; converted into "
                "OUTPUT_DIR/init_from first, tokenizer and mask token included) or a LookAround checkpoint"})
    lora_r: int = field(default=0, metadata={"help": "train LoRA adapters of this rank (peft) instead of every "
                                                     "weight; they are merged into the final model (0: full training)"})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA scale numerator (default 2 * lora_r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA branch"})
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "comma-separated module names that get adapters (default: q_proj,k_proj,v_proj,o_proj,gate_proj,"
                "up_proj,down_proj, those the model has)"})


@dataclass
class DataArguments:
    train_files: list[str] = field(
        default_factory=list, metadata={"help": "text (.txt), JSON Lines (.jsonl, .json, .gz) or .parquet files or folders"}
    )
    validation_files: list[str] = field(default_factory=list, metadata={"help": "held-out files or folders"})
    dataset_name: str | None = field(default=None, metadata={"help": "a `datasets` name (network or cache needed)"})
    dataset_config_name: str | None = None
    text_column: str = field(default="text", metadata={"help": "JSON field / dataset column holding the text"})
    validation_split_percentage: float = field(
        default=5.0, metadata={"help": "documents held out for validation when no validation data is given"}
    )
    block_size: int = field(default=256, metadata={"help": "tokens per training block, BOS included"})
    max_train_samples: int | None = field(default=None, metadata={"help": "truncate the training blocks"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "truncate the validation blocks"})
    perplexity_max_documents: int = field(
        default=100, metadata={"help": "validation documents scored with the p(x_k|x_<k) protocol at the end (a "
                                       "random sample, seeded by --seed)"}
    )
    perplexity_max_tokens: int | None = field(
        default=None,
        metadata={"help": "validation tokens scored with the p(x_k|x_<k) protocol at the end. Default: about what "
                          "the training cost (3 forward rows per trained block), and at most --max_eval_samples "
                          "blocks when given"},
    )
    perplexity_positions_per_window: int = field(
        default=16,
        metadata={"help": "masked/GVP checkpoints: prefix lengths scored per window at the end (evenly spaced; one "
                          "forward row each, so all of a 256-token window cost 256 rows); 0: every position"},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "processes that tokenize and pack (datasets .map num_proc); not with --streaming"}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "datasets cache (default: HF_DATASETS_CACHE)"})
    overwrite_cache: bool = field(default=False, metadata={"help": "tokenize and pack again instead of loading the cache"})
    streaming: bool = field(
        default=False,
        metadata={"help": "read, tokenize and pack on the fly (datasets IterableDataset), split across ranks; "
                          "nothing is written to disk. Needs --max_steps"},
    )
    shuffle_buffer_size: int = field(
        default=10_000, metadata={"help": "--streaming: blocks shuffled within a buffer of this size (0: stream order)"}
    )


class ObjectiveArgumentsBase:
    """What ``ObjectiveArguments`` does with its flags: the objective's parameters dataclass (``Params`` of its module
    in :mod:`hf_lookaround.objectives`) checks them, and gives the plan's and the collator's parameters."""

    def __post_init__(self):
        if self.objective not in objectives.PLAN_NAMES:
            raise ValueError(f"--objective must be one of {objectives.PLAN_NAMES}, got {self.objective!r}")
        self._refuse_other_forms()
        if self.mixture and not self.is_mixture:
            raise ValueError(f"--mixture applies only with --objective mixture (got --objective {self.objective}); "
                             "add --objective mixture or drop --mixture")
        self.params  # every flag of the objective (and of a mixture's components) checked now, not mid-run

    def _refuse_other_forms(self) -> None:
        """A flag of another objective (a form such as --dar_form, or a value such as --mask_ratio) set for an
        objective it does not belong to: the objectives' ``Params`` say which flags are whose."""
        own = set(objectives.get(self.objective).flags) | {"objective", "mixture"}  # --mixture: checked below
        if self.is_mixture:  # a mixture's components take their own flags (the one-stream mixture)
            own |= {flag for name in self._component_names() for flag in objectives.get(name).flags}
        for f in dataclasses.fields(self):
            if f.name not in own and getattr(self, f.name) != _default(f):
                owners = [name for name, o in objectives.OBJECTIVES.items() if f.name in o.flags]
                value = getattr(self, f.name)
                value = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
                raise ValueError(f"--{f.name} {value} applies to --objective {' / '.join(owners)} only, "
                                 f"not --objective {self.objective}; drop --{f.name}")

    def objective_params(self, name: str):
        """``name``'s parameters dataclass, from the flags it owns."""
        o = objectives.get(name)
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(o.Params) if f.metadata.get("cli", True)}
        if o.family == objectives.MIXTURE:
            given["components"] = {c: self._component(c).plan_params() for c in self._component_names()}
            given["component_collators"] = {c: self._component(c).collator_params() for c in self._component_names()}
            given["component_fields"] = {c: self._component(c).config_fields() for c in self._component_names()}
        return o.Params(**given)

    def _component_names(self) -> list[str]:
        """The --mixture names that are objectives other than a mixture (check_mixture names the others)."""
        return [name for name in self.mixture_weights()
                if name in objectives.OBJECTIVES and objectives.family(name) != objectives.MIXTURE]

    def _component(self, name: str):
        try:
            return self.objective_params(name)
        except ValueError as error:
            raise ValueError(f"mixture: component {name!r}: {error}") from None

    @property
    def params(self):
        return self.objective_params(self.objective)

    @property
    def is_mixture(self) -> bool:
        return objectives.family(self.objective) == objectives.MIXTURE

    def mixture_weights(self) -> dict[str, float]:
        """``--mixture dar=0.5 vmlm=0.5`` as ``{name: weight}`` (as given, not yet normalised)."""
        return objectives.mixture.parse_weights(self.mixture)

    @property
    def single_stream(self) -> bool:
        """A classic single-stream form: GPT's next token (ar), BERT's [MASK] inputs (masked family)."""
        return self.params.form == objectives.SINGLE_STREAM

    @property
    def single_stream_head(self) -> str | None:
        return objectives.get(self.objective).single_stream_head if self.single_stream else None

    def plan_params(self) -> dict:
        """The keyword arguments of the plan function (stored in ``config.plan_params``); for a mixture,
        ``{"mixture": normalised weights, "components": {name: that objective's plan parameters}}``."""
        return self.params.plan_params()

    def collator_params(self) -> dict:
        return self.params.collator_params()

    def check_block_size(self, block_size: int) -> None:
        names = self.mixture_weights() if self.is_mixture else [self.objective]
        for name in names:
            self.objective_params(name).check_block_size(block_size)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _objective_fields() -> list[tuple]:
    """The flags of every objective module, once each (a flag that several objectives share, such as --masked_form,
    must have one default and one type)."""
    merged: dict[str, tuple] = {}
    for o in objectives.OBJECTIVES.values():
        hints = typing.get_type_hints(o.Params)
        for f in dataclasses.fields(o.Params):
            if not f.metadata.get("cli", True):
                continue
            if f.name in merged:
                if _default(merged[f.name][2]) != _default(f):
                    raise TypeError(f"objectives share the flag --{f.name} with different defaults")
                continue
            merged[f.name] = (f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory,
                                                           metadata=dict(f.metadata)))
    return list(merged.values())


# `hf-lookaround pretrain`'s objective flags: --objective, and every objective module's parameters
ObjectiveArguments = dataclasses.make_dataclass(
    "ObjectiveArguments",
    [("objective", str, field(default="ar", metadata={"help": f"one of {objectives.PLAN_NAMES}"})),
     *_objective_fields()],
    bases=(ObjectiveArgumentsBase,),
)
ObjectiveArguments.__module__ = __name__


# ---------------------------------------------------------------------------------------------
# Trainer pieces
# ---------------------------------------------------------------------------------------------
class NamedProgressCallback(ProgressCallback):
    """Trainer's progress bar with a name before it ("seed 0, mlm"): the demo trains several in a row."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(self.label)


class CollatorEpochCallback(TrainerCallback):
    """Tell the collator the epoch, so that a batch seen again in a later epoch gets a new plan.

    ``on_epoch_begin`` runs before the epoch's dataloader iterator (and its workers) is created; persistent
    workers, created once, read the epoch from the collator's shared memory.
    On resume, ``state.epoch`` is restored from the checkpoint, so the epoch is the same as in an
    uninterrupted run."""

    def __init__(self, collator: PlanCollator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.set_epoch(int(math.floor((state.epoch or 0.0) + 1e-6)))


GPU_DATALOADER_WORKERS = 2


@dataclass
class LookAroundTrainingArguments(TrainingArguments):
    """transformers' ``TrainingArguments`` plus a fixed global batch."""

    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "examples per optimizer step over all processes; sets gradient_accumulation_steps = "
                          "global / (per_device_train_batch_size x processes), which must divide exactly"},
    )
    # Trainer's default (None) means find_unused_parameters=True for a PreTrainedModel: a slower DDP that
    # searches the graph every step. Every LookAround head uses all its trainable parameters (the
    # single-stream heads freeze the query stream's), so the fast setting, accelerate's default, is safe.
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={"help": "DDP's find_unused_parameters (default False: every trainable parameter gets a gradient)"},
    )
    # Trainer collates in the main process by default (0 workers), inside the GPU step. Worker processes
    # collate the next batches while the GPU computes; plans do not depend on the number of workers
    # (per-batch seeds, see collators.py), so the default changes no result.
    dataloader_num_workers: int | None = field(
        default=None,
        metadata={"help": f"data loader worker processes; default: {GPU_DATALOADER_WORKERS} when training on a CUDA "
                          "GPU from a map-style dataset (they collate while the GPU computes), else 0 (the main "
                          "process collates). Plans are the same for any number of workers"},
    )
    dataloader_workers_by_default: bool = field(default=False, init=False, repr=False)
    # Trainer forks new workers at every epoch: with few blocks per rank (DDP) that start-up lands inside steps
    # (issue 41: 14 ms a step on 4 H100s). Persistent workers read the collator's epoch from shared memory, set
    # before each epoch's iterator, so plans are unchanged.
    dataloader_persistent_workers: bool | None = field(
        default=None,
        metadata={"help": "keep data loader workers between epochs; default: on whenever there are workers"},
    )
    # DDP: 25 MB buckets leave the last ones (the embedding's gradient) unoverlapped, and broadcasting buffers
    # (RoPE's inv_freq, the same on every rank) is a collective before every forward. With 100 MB buckets, no
    # broadcast (and gradients as bucket views) one-stream dar ran 1.11x faster on 4 H100s (docs/distributed.md).
    ddp_bucket_cap_mb: int | None = field(
        default=100, metadata={"help": "DDP gradient bucket size in MB (default 100; PyTorch's is 25)"})
    ddp_broadcast_buffers: bool | None = field(
        default=False,
        metadata={"help": "DDP: broadcast buffers before each forward (default False: LookAround's buffers are "
                          "deterministic, the same on every rank)"},
    )
    # transformers 5 dropped TrainingArguments.overwrite_output_dir; pretraining keeps its meaning
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "start a new run in an output_dir that holds another run's checkpoints or model: its "
                          "checkpoint-N folders are deleted first (without this, or --resume_from_checkpoint, "
                          "an occupied output_dir is refused)"},
    )
    resume_weights_only: bool = field(
        default=False,
        metadata={"help": "--resume_from_checkpoint from a checkpoint without optimizer, scheduler or RNG state (one "
                          "saved with --save_only_model): go on from its weights (and step) with a fresh optimizer, "
                          "learning-rate schedule and RNG, with a warning naming what was not restored. Without "
                          "this, such a resume is refused"},
    )
    drop_unread_content: bool | None = field(
        default=None,
        metadata={"help": "two-stream training: leave out the content rows no prediction reads (a masked plan's "
                          "masked tokens, GVP's last group, padding) in the data loader; same loss and gradients, "
                          "less work (MAE's encoder on the visible tokens). Default: on for the masked objectives and "
                          "GVP (mlm 1.06x, gvp 1.10x tokens/s through this command on an H100, docs/benchmarks.md), "
                          "off for ar, dar and mixtures (they leave about one row per sequence unread)",
                  "nargs": "?", "const": True},  # a bare --drop_unread_content still means true
    )
    attention_annealing_steps: int = field(
        default=0,
        metadata={"help": "attention-mask annealing (DiffuLLaMA), for adapting a causal LM (--init_from): over the "
                          "first N training steps the mask moves from causal to the objective's; at step s every "
                          "later key is visible with probability s / N (a threshold per key). 0: off. Refused for "
                          "objectives whose mask never shows a later token (ar)"},
    )

    def __post_init__(self):
        if not self.use_cpu and launched_on_cpu_only():
            # without use_cpu, transformers sets up no process group on a machine without an accelerator: each
            # torchrun process would train alone, as rank 0 of a world of 1, and they would race for output_dir
            logger.info("%s processes and no accelerator: training on the CPU with gloo (--use_cpu true)",
                        os.environ["WORLD_SIZE"])
            self.use_cpu = True
        if self.dataloader_num_workers is None:
            self.dataloader_workers_by_default = True
            self.dataloader_num_workers = default_dataloader_workers(self.use_cpu)
        if self.dataloader_persistent_workers is None:
            self.dataloader_persistent_workers = self.dataloader_num_workers > 0
        self.dataloader_pin_memory = self.dataloader_pin_memory and pin_memory_useful(self.use_cpu)
        check_trainer_values(self)
        super().__post_init__()


def check_trainer_values(args) -> None:
    """Trainer values that fail deep in a run (a ZeroDivisionError after the model is built) or quietly mean "off"
    (0 saves, a negative limit, a NaN clipping norm), refused in one line before any work."""
    if getattr(args, "attention_annealing_steps", 0) < 0:
        raise ValueError(f"--attention_annealing_steps {args.attention_annealing_steps}: must be >= 0 (training "
                         "steps over which the mask moves from causal to the objective's; 0: off)")
    if args.gradient_accumulation_steps < 1:
        raise ValueError(f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: must be >= 1 (batches "
                         "per optimizer step)")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "steps" and args.save_steps <= 0:
        raise ValueError(f"--save_steps {args.save_steps:g}: must be > 0 (steps between checkpoints, or a fraction "
                         "of the run below 1); to save no checkpoint, pass --save_strategy no")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise ValueError(f"--save_total_limit {args.save_total_limit}: must be >= 1 (checkpoints kept); leave it out "
                         "to keep every checkpoint")
    if not math.isfinite(args.max_grad_norm) or args.max_grad_norm < 0:
        raise ValueError(f"--max_grad_norm {args.max_grad_norm}: must be a finite number >= 0 (0: no clipping)")
    if args.logging_steps <= 0 and str(getattr(args.logging_strategy, "value", args.logging_strategy)) == "steps":
        raise ValueError(f"--logging_steps {args.logging_steps:g}: must be > 0")


def launched_on_cpu_only() -> bool:
    """Whether this process is one of several (torchrun, accelerate launch: ``WORLD_SIZE`` > 1) on a machine
    with no accelerator (no CUDA GPU, nor any other device torch knows)."""
    import torch

    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    if world <= 1:
        return False
    accelerator = getattr(torch, "accelerator", None)
    has_accelerator = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    return not has_accelerator


def pin_memory_useful(use_cpu: bool) -> bool:
    """Pinned host memory speeds copies to an accelerator; on a CPU run torch's data loader only warns that there
    is none (once per run), so the data loaders pin only when an accelerator is there and used."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return not use_cpu and (accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


def default_dataloader_workers(use_cpu: bool) -> int:
    """Data loader workers when none are asked for: some on a CUDA GPU, none on the CPU (workers there would
    take cores from the model's own step)."""
    import torch

    return GPU_DATALOADER_WORKERS if torch.cuda.is_available() and not use_cpu else 0


def gradient_accumulation_for(global_batch_size: int, per_device_batch_size: int, world_size: int) -> int:
    """Accumulation steps so that ``per_device x world_size x steps == global_batch_size``; else an error."""
    if global_batch_size <= 0 or per_device_batch_size <= 0:
        raise ValueError(
            f"--global_batch_size ({global_batch_size}) and --per_device_train_batch_size "
            f"({per_device_batch_size}) must be positive"
        )
    per_step = per_device_batch_size * world_size
    if global_batch_size % per_step:
        raise ValueError(
            f"--global_batch_size {global_batch_size} is not a multiple of --per_device_train_batch_size "
            f"{per_device_batch_size} x {world_size} process(es) = {per_step}: choose a global batch that is, "
            f"or a per-device batch / number of processes that divides it"
        )
    return global_batch_size // per_step


def apply_global_batch_size(training_args: TrainingArguments) -> None:
    """Derive ``gradient_accumulation_steps`` from ``--global_batch_size`` for this world size."""
    global_batch = getattr(training_args, "global_batch_size", None)
    if global_batch is None:
        return
    steps = gradient_accumulation_for(
        global_batch, training_args.per_device_train_batch_size, training_args.world_size
    )
    if training_args.gradient_accumulation_steps not in (1, steps):
        raise ValueError(
            f"--global_batch_size {global_batch} implies --gradient_accumulation_steps {steps}, but "
            f"{training_args.gradient_accumulation_steps} was given: pass only one of the two"
        )
    training_args.gradient_accumulation_steps = steps


class LookAroundTrainer(Trainer):
    """``Trainer`` with a fixed-plan evaluation collator, the objective's perplexity in eval metrics, and
    checkpoints that are complete or ignored (see :mod:`hf_lookaround.training.checkpointing`).

    Build it with :func:`build_trainer`. It overrides public methods where it can (``compute_loss``, the data
    loaders, ``evaluation_loop``, ``save_model``); each private one it overrides says why no public hook serves."""

    def __init__(self, *args, eval_data_collator=None, run_settings: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # transformers 5's Trainer writes TrainingArguments.use_cache (default False) into the config, and so into
        # every saved checkpoint, whose generate() then decodes without a KV cache. Training never uses the cache
        # (the model ignores it in train mode), so the checkpoints keep the config's own default
        if getattr(self.model, "config", None) is not None and not self.args.use_cache:
            self.model.config.use_cache = True
        self.eval_data_collator = eval_data_collator
        self.run_settings = run_settings  # recorded in each checkpoint's marker, checked on resume
        checkpointing.allow_indexed_cpu_map_location()  # resuming a multi-process CPU run

    # private: no public hook runs between a checkpoint's files and Trainer's rotation (on_save comes after it)
    def _save_checkpoint(self, model, trial):
        # Trainer rotates old checkpoints at the end of its save; here rotation waits until the new
        # checkpoint is marked complete, so a kill mid-save never leaves fewer complete checkpoints.
        limit = self.args.save_total_limit
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # a save never writes into a folder that already holds files (and perhaps a marker) of another save:
        # the old folder is moved aside first, so its marker can never stand beside new files
        replaced = None
        if self.args.should_save and os.path.exists(folder):
            replaced = checkpointing._set_aside(Path(folder), "replaced")
            logger.warning("%s existed before this save: moved aside to %s", folder, replaced.name)
        self.accelerator.wait_for_everyone()  # no process writes into the folder before it is moved aside
        self.args.save_total_limit = None
        try:
            with checkpointing.save_failure_is_one_line(folder):
                super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every process has written its files (RNG states, shards)
        if self.args.should_save:
            checkpointing.mark_complete(folder, self.state.global_step, self.args.world_size, self.run_settings)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)  # the new checkpoint is complete: the old one goes
            checkpointing.rotate_complete_checkpoints(run_dir, limit, keep=[self.state.best_model_checkpoint])

    # private (and the next): train() loads a checkpoint's pickled state here, and no public hook wraps the load
    def _load_rng_state(self, checkpoint):
        with checkpointing.unsafe_pickle_is_one_line(checkpoint, "rng_state*.pth"):
            return super()._load_rng_state(checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with checkpointing.unsafe_pickle_is_one_line(checkpoint, "optimizer.pt or scheduler.pt"):
            return super()._load_optimizer_and_scheduler(checkpoint)

    # private (and the next): Trainer writes a model's weights here, and no public hook chooses the state dict it
    # writes. A LoRA run's save: the merged weights as model.safetensors (a plain checkpoint of that step) and the
    # adapted modules apart (adaptation.LORA_STATE_NAME), from which a resume goes on exactly
    def _save(self, output_dir=None, state_dict=None):
        from ..adaptation import LORA_STATE_NAME, lora_checkpoint_state

        parts = lora_checkpoint_state(self.accelerator.unwrap_model(self.model), state_dict)
        if parts is None:
            return super()._save(output_dir, state_dict)
        merged, lora = parts
        super()._save(output_dir, merged)
        folder = output_dir or self.args.output_dir
        if not os.path.basename(os.path.normpath(folder)).startswith(PREFIX_CHECKPOINT_DIR):
            return  # the final model (under FSDP2 its adapters are not merged in place): plain, no adapter file
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in lora.items()},
                  os.path.join(folder, LORA_STATE_NAME), metadata={"format": "pt"})

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from ..adaptation import load_lora_checkpoint

        target = model if model is not None else self.model
        result = load_lora_checkpoint(target, resume_from_checkpoint)
        if result is None and checkpointing.full_weights_for_unwrapped_fsdp_model(self, target, resume_from_checkpoint):
            # a finished FSDP run evaluated again: the final model holds full weights, no FSDP files, and no
            # training wrapped the model, so it loads them as Trainer does without FSDP (Trainer would look for shards)
            from safetensors.torch import load_file

            result = target.load_state_dict(load_file(os.path.join(resume_from_checkpoint, "model.safetensors")),
                                            strict=False)
        if result is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._issue_warnings_after_load(result)

    def save_model(self, output_dir=None, _internal_call=False):
        from ..adaptation import lora_modules

        folder = output_dir or self.args.output_dir
        with checkpointing.save_failure_is_one_line(folder):
            # FSDP's SHARDED_STATE_DICT: Trainer writes no weights and no config here (a checkpoint's shards come
            # later); checkpointing.state_for_sharded_save says what to write instead (on every rank: collectives)
            adapters = checkpointing.saves_sharded_state_dict(self) and \
                bool(lora_modules(self.accelerator.unwrap_model(self.model)))
            state = checkpointing.state_for_sharded_save(self, folder, adapters=adapters)
            if state is not None and self.args.should_save:
                if state is checkpointing.WEIGHTS_ARE_SHARDS:  # the config and tokenizer the resume checks read
                    self._save_without_weights(folder)
                elif state:  # the final model, a LoRA run's checkpoint: full weights, as FULL_STATE_DICT writes
                    self._save(folder, state_dict=state)
            return super().save_model(output_dir, _internal_call)  # under SHARDED_STATE_DICT: writes no weights

    def _save_without_weights(self, output_dir) -> None:
        """What ``_save`` writes besides the weights: config, generation config, tokenizer, training arguments."""
        import torch
        from transformers.trainer import TRAINING_ARGS_NAME

        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        model.config.save_pretrained(output_dir)
        if model.can_generate() and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    # private: the dynamo plugin is built here, and TrainingArguments has no option for its `dynamic`
    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile and args.get("dynamo_plugin") is not None and args["dynamo_plugin"].dynamic is None:
            # one static graph per batch shape (a compiled step sees a few: targets are padded to a fixed width,
            # dropped content to a multiple of 64). Left to itself, dynamo turns the second width it sees into a
            # symbolic one, and inductor failed on such graphs of the two-stream step (issue 22: GVP)
            args["dynamo_plugin"].dynamic = False
        return args

    # private: Trainer counts the loss's items here (get_batch_samples and prediction_step both call it) from `labels`
    def _get_num_items_in_batch(self, batch_samples, device):
        # a batch without unread content (DropUnreadContent) carries its labels as query_target_ids, one per query row
        samples = [dict(b, labels=b["query_target_ids"]) if "labels" not in b and "query_target_ids" in b else b
                   for b in batch_samples]
        return super()._get_num_items_in_batch(samples, device)

    def compute_loss(self, model, inputs, *args, **kwargs):
        inner = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        config = getattr(inner, "config", None)
        inputs = self.with_attention_annealing(model.training, config, inputs)
        if is_one_stream_group_model(config) or is_block_diffusion_model(config):
            # dar's and bd3lm's one-stream batches are laid out by the collator; without the flag the causal LM would
            # read them as plain token ids (its next-token view), and bd3lm's masked LM refuses them
            inputs = {**inputs, "one_stream_layout": True}
        # under --torch_compile the attention masks (a FlexAttention BlockMask above all) are built here, once per
        # batch (a block-causal one once per run) and outside the compiled graph, which cannot build a BlockMask
        if self.args.torch_compile and "prepared_attention" not in inputs:
            block_causal = getattr(inner.config, "default_attention", None) in ("block_causal", "block_diffusion")
            if ("group_ids" in inputs or block_causal) and hasattr(inner, "prepare_attention"):
                inputs = {**inputs, "prepared_attention": inner.prepare_attention(**inputs)}
        return super().compute_loss(model, inputs, *args, **kwargs)

    def with_attention_annealing(self, training: bool, config, inputs: dict) -> dict:
        """--attention_annealing_steps N: during the first N training steps the batch carries the keys revealed at
        progress ``p = global_step / N`` (``masking_lookaround.annealing_revealed_keys``), which the model's mask
        rule applies on top of the plan's. The Trainer holds the step, so the progress enters here, per batch (a
        collator in a worker process cannot see it); evaluation and steps from N on use the plain objective."""
        steps = getattr(self.args, "attention_annealing_steps", 0) or 0
        step = self.state.global_step
        if steps <= 0 or step >= steps or not training or "revealed_keys" in inputs:
            return inputs
        from ..models.lookaround.masking_lookaround import annealing_revealed_keys

        tokens = inputs["input_ids"]
        # bd3lm's one-stream batch is x_t ⊕ x_0: a token's two copies are revealed together
        copies = 2 if is_block_diffusion_model(config) else 1
        return {**inputs, "revealed_keys": annealing_revealed_keys(step / steps, *tokens.shape, device=tokens.device,
                                                                   copies=copies)}

    def get_train_dataloader(self):
        # a stream that split_dataset_by_node already split per rank must not be split again by accelerate
        if not is_split_by_node(self.train_dataset):
            return super().get_train_dataloader()
        with rank_local_prepare(self.accelerator):
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        # evaluation draws the same plans every time (a fixed collator at epoch 0), so eval losses
        # of successive evaluations are comparable
        if self.eval_data_collator is None:
            return super().get_eval_dataloader(eval_dataset)
        train_collator, self.data_collator = self.data_collator, self.eval_data_collator
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = train_collator

    def evaluation_loop(self, *args, **kwargs):
        output = super().evaluation_loop(*args, **kwargs)
        for key in [k for k in output.metrics if k.endswith("_loss")]:
            output.metrics[key[: -len("loss")] + "objective_perplexity"] = math.exp(min(output.metrics[key], 50.0))
        return output


# ---------------------------------------------------------------------------------------------
# Building blocks (the training assembly, build_trainer below, puts them together)
# ---------------------------------------------------------------------------------------------
def load_tokenizer(model_args: ModelArguments, train_texts=None, save_dir=None, block_size=None):
    """The tokenizer named by ``--tokenizer_name`` (or the checkpoint's), or one trained on ``train_texts``
    (any iterable of documents: a generator over the dataset's text column, never a list of the corpus)."""
    if model_args.train_tokenizer:
        from ..data.tokenization import train_tokenizer

        if train_texts is None:
            raise ValueError("--train_tokenizer needs training text")
        logger.info("training a byte-level BPE tokenizer (%d tokens)", model_args.tokenizer_vocab_size)
        return train_tokenizer(train_texts, vocab_size=model_args.tokenizer_vocab_size, model_max_length=block_size,
                               output_dir=save_dir)
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        raise ValueError("give a tokenizer (--tokenizer_name DIR_OR_HUB_NAME) or pass --train_tokenizer to train one")
    tokenizer = auto_tokenizer(name)
    if tokenizer.pad_token is None:
        # blocks all have the same length, so padding never reaches the loss; collators still need an id
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare_tokenizer(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments,
                      train_raw, block_size: int):
    """Load the tokenizer on every rank; with ``--train_tokenizer`` the main process alone trains it (from an
    iterator over the text column) and saves it to ``output_dir/tokenizer``, and the other ranks wait and load
    that folder (it must be on a file system every node sees). A resumed run reuses the saved tokenizer."""
    if not model_args.train_tokenizer:
        return load_tokenizer(model_args)
    save_dir = os.path.join(training_args.output_dir, "tokenizer")
    saved = os.path.isfile(os.path.join(save_dir, "tokenizer_config.json"))
    with training_args.main_process_first(local=False, desc="training the tokenizer"):
        if training_args.process_index == 0 and not (saved and training_args.resume_from_checkpoint):
            texts = iter_dataset_texts(train_raw, data_args.text_column, max_documents=model_args.tokenizer_max_documents)
            load_tokenizer(model_args, texts, save_dir=save_dir, block_size=block_size)
    if saved and training_args.resume_from_checkpoint:
        logger.info("resuming: the tokenizer trained by the first run is reused from %s", save_dir)
    # every rank (the main one too) loads the saved files, so all hold the very same tokenizer
    return auto_tokenizer(save_dir)


def check_tokenizer(tokenizer, objective_args: ObjectiveArguments) -> None:
    feeds_mask = objective_args.single_stream_head == objectives.MASKED_HEAD or (
        objective_args.is_mixture and objective_args.single_stream)  # the one-stream mixture's masked rows
    if feeds_mask and tokenizer.mask_token_id is None:
        raise ValueError(
            f"--objective {objective_args.objective} --masked_form single_stream feeds [MASK] inputs, but the tokenizer "
            "has no mask token: use a tokenizer with one (e.g. --train_tokenizer) or --masked_form two_stream"
        )
    if tokenizer.bos_token_id is None and tokenizer.cls_token_id is None:
        raise ValueError("the tokenizer has no BOS or CLS token to start each block with (the rank-0 condition token)")


def _override_value(config, key: str, value: str):
    """``value`` of ``--config_overrides key=value`` as the type the field holds (JSON for booleans and None)."""
    old = getattr(config, key)
    try:
        return type(old)(value) if old is not None and not isinstance(old, bool) else json.loads(value)
    except ValueError:
        kind = "JSON (true, false, null, a number)" if old is None or isinstance(old, bool) else type(old).__name__
        raise ValueError(f"--config_overrides {key}={value}: the field {key!r} takes {kind}, got {value!r}") from None


def build_config(model_args: ModelArguments, objective_args: ObjectiveArguments, tokenizer, block_size: int):
    from ..models.lookaround.configuration_lookaround import LookAroundConfig

    if model_args.model_name_or_path:
        from ..hub.weights import check_local_checkpoint

        check_local_checkpoint(model_args.model_name_or_path, "hf-lookaround pretrain")  # a LookAround text model
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    elif model_args.config_name:
        path = Path(model_args.config_name)
        config = LookAroundConfig.from_json_file(path) if path.is_file() else LookAroundConfig.from_pretrained(path)
    else:
        config = LookAroundConfig.from_preset(model_args.preset)
    if model_args.config_overrides:
        for item in model_args.config_overrides.split(","):
            key, _, value = item.partition("=")
            if not hasattr(config, key.strip()):
                raise ValueError(f"--config_overrides: the config has no field {key.strip()!r}")
            setattr(config, key.strip(), _override_value(config, key.strip(), value))
    if not model_args.model_name_or_path:
        config.vocab_size = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"):
            setattr(config, name, getattr(tokenizer, name, None))
    elif len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the checkpoint's vocabulary has {config.vocab_size}")
    width = objective_args.params.input_width(block_size)  # a form may add start rows to each block
    if width > config.max_position_embeddings:
        extra = f" (plus {width - block_size} start rows of --{objective_args.objective}_form)" if width > block_size else ""
        raise ValueError(
            f"--block_size {block_size}{extra} is larger than the model's max_position_embeddings "
            f"({config.max_position_embeddings}): lower --block_size or raise max_position_embeddings"
        )
    config.objective = objective_args.objective
    config.plan_params = objective_args.plan_params()
    config.default_attention = objectives.default_attention(objective_args.objective, config.plan_params)
    if objective_args.is_mixture:
        config.mixture = dict(config.plan_params["mixture"])  # the weights, for a reader of config.json
    config.prediction_stream = "content" if objective_args.single_stream else "query"  # the stream trained to predict
    config.trained_block_size = block_size  # max_position_embeddings stays the capacity: the trained length is this
    for name, value in objective_args.params.config_fields().items():  # e.g. dar's one-stream block-causal pattern
        setattr(config, name, value)
    config.validate_lookaround()
    return config


def build_model(config, model_args: ModelArguments, objective_args: ObjectiveArguments):
    from ..models.lookaround.modeling_lookaround import (
        LookAroundForCausalLM,
        LookAroundForMaskedLM,
        LookAroundForPreTraining,
    )

    cls = LookAroundForPreTraining
    if objective_args.single_stream:
        cls = {objectives.CAUSAL_HEAD: LookAroundForCausalLM, objectives.MASKED_HEAD: LookAroundForMaskedLM}[
            objective_args.single_stream_head]
    kwargs = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    if model_args.model_name_or_path:
        from ..hub.load import load_checkpoint

        model = load_checkpoint(cls, model_args.model_name_or_path, "hf-lookaround pretrain", config=config, **kwargs)
    else:
        model = cls._from_config(config, **kwargs)
    from ..adaptation import with_lora

    return with_lora(model, model_args)  # --lora_r: adapters instead of full training


def build_collators(objective_args: ObjectiveArguments, tokenizer, seed: int, block_size: int, static_shapes: bool):
    """The training collator (per-batch seeds from ``seed``) and a fixed-plan evaluation collator."""
    params = objective_args.collator_params()
    if static_shapes and not objective_args.single_stream:
        plan_params = objective_args.plan_params()
        params["pad_targets_to"] = objectives.max_targets(objective_args.objective, block_size, **plan_params)
    train = objectives.make_collator(objective_args.objective, tokenizer, seed=seed, **params)
    evaluation = objectives.make_collator(objective_args.objective, tokenizer, seed=seed + 1, **params)
    return train, evaluation


def without_unread_content(collator, objective_args: ObjectiveArguments, training_args: TrainingArguments,
                           block_size: int):
    """The training collator, wrapped in `DropUnreadContent` where --drop_unread_content (default: the masked
    objectives and GVP, whose top rank holds many tokens) asks for it."""
    masked = objectives.family(objective_args.objective) == objectives.MASKED
    drop = getattr(training_args, "drop_unread_content", None)  # a plain TrainingArguments: the objective's default
    by_default = objectives.get(objective_args.objective).drops_unread_content
    if not (by_default if drop is None else drop) or objective_args.single_stream:
        return collator
    from .unread_content import DropUnreadContent

    # a compiled step sees a few widths, one static graph each: a masked plan keeps about the same count in every
    # batch (one or two multiples of 64); other plans' widths spread over the block (a quarter of it). An eager
    # step takes the exact width
    multiple = (64 if masked else max(64, block_size // 4)) if training_args.torch_compile else None
    # one width for every batch where the objective bounds what it keeps (masked family: at most T (1 - least
    # ratio) rows), rounded up to the multiple: one compiled graph per run, whatever the data
    bound = objectives.max_content_rows(objective_args.objective, block_size, **objective_args.plan_params())
    min_width = None
    if multiple and bound is not None:
        min_width = min(block_size, -(-bound // multiple) * multiple)
    return DropUnreadContent(collator, width_multiple=multiple, min_width=min_width)


# ---------------------------------------------------------------------------------------------
# The training assembly: the command, the demo and the study's workers all build their Trainer here
# ---------------------------------------------------------------------------------------------
def build_trainer(config, model_args: ModelArguments, objective_args: ObjectiveArguments,
                  training_args: TrainingArguments, tokenizer, train_dataset, eval_dataset=None, *, block_size: int,
                  callbacks=(), run_settings: dict | None = None) -> "LookAroundTrainer":
    """A pretraining run put together: config -> model -> collators -> unread-content policy -> Trainer.

    ``config``: from :func:`build_config`. The model's initial weights are drawn from ``training_args.seed``
    (the same weights for every objective of a seed). The training collator draws per-batch plans from the seed,
    the evaluation collator a fixed plan (seed + 1); the training one is wrapped by the unread-content policy
    (``training_args.drop_unread_content``: ``None`` or a plain ``TrainingArguments`` means the objective's
    default, :func:`without_unread_content`). ``callbacks``: more ``TrainerCallback``s, after the one that tells
    the collator the epoch. ``run_settings``: recorded in each checkpoint's marker, checked on resume."""
    import torch

    check_attention_annealing(objective_args, getattr(training_args, "attention_annealing_steps", 0), block_size)
    torch.manual_seed(training_args.seed)  # the initial weights of this seed
    model = build_model(config, model_args, objective_args)
    train_collator, eval_collator = build_collators(
        objective_args, tokenizer, training_args.seed, block_size, static_shapes=bool(training_args.torch_compile))
    # evaluation keeps whole batches: Trainer computes an eval loss only for batches with `labels`
    train_collator = without_unread_content(train_collator, objective_args, training_args, block_size)
    # only the loss is needed from evaluation: gathering (B, M, V) logits would waste memory
    training_args.prediction_loss_only = True
    if run_settings is not None:
        # a resume restores the checkpoint's schedule: a new learning rate or schedule would be ignored without a word
        run_settings = {**run_settings, "learning_rate": training_args.learning_rate,
                        "lr_scheduler_type": str(getattr(training_args.lr_scheduler_type, "value",
                                                         training_args.lr_scheduler_type))}
    return LookAroundTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=train_collator,
        eval_data_collator=eval_collator,
        processing_class=tokenizer,
        # a run that diverges stops in one line, and no marker calls non-finite weights complete
        callbacks=[CollatorEpochCallback(train_collator), FiniteTrainingGuard(), *callbacks],
        run_settings=run_settings,
    )


def check_attention_annealing(objective_args: ObjectiveArguments, steps: int, block_size: int) -> None:
    """Refuse --attention_annealing_steps where it means nothing: no prediction of the objective reads a later token
    (ar; dar's two-stream form, whose query rows read earlier groups only), so there is nothing to anneal. Read
    from the objective's own plan (a few drawn blocks), not from a list of names: a single-stream row predicts from
    the keys its rank lets it see (``g[k] <= g[i]``), a two-stream target from lower ranks (``g[k] < g[i]``, which
    also bounds what the content rows it reads saw)."""
    if not steps:
        return
    import torch

    lengths = torch.full((16,), block_size)
    plan = objectives.make_plan(objective_args.objective, lengths, block_size,
                                generator=torch.Generator().manual_seed(0), **objective_args.plan_params())
    ranks, later = plan.group_ids, torch.ones(block_size, block_size, dtype=torch.bool).triu(1)  # [i, k]: k after i
    if objective_args.single_stream:
        reads_later = (ranks[:, None, :] <= ranks[:, :, None]) & later
    else:
        reads_later = (ranks[:, None, :] < ranks[:, :, None]) & later & plan.is_target[:, :, None]
    if not reads_later.any():
        raise ValueError(f"--attention_annealing_steps: no prediction of {objective_args.objective} "
                         f"({'single' if objective_args.single_stream else 'two'}-stream) reads a later token, so "
                         "there is nothing to anneal from causal; drop the flag")


def check_launch(training_args: TrainingArguments) -> None:
    """Refuse the one launch that cannot work: one process on several GPUs with --torch_compile."""
    from transformers.training_args import ParallelMode

    if training_args.torch_compile and training_args.n_gpu > 1 and \
            training_args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:
        raise ValueError(
            f"--torch_compile in one process on {training_args.n_gpu} visible GPUs: Trainer would wrap the model in "
            "DataParallel, which splits the batch but not the attention masks prepared outside the compiled graph. "
            f"Start one process per GPU: accelerate launch --config_file examples/accelerate/ddp.yaml "
            f"--num_processes {training_args.n_gpu} -m hf_lookaround.cli pretrain ... (or show one GPU with "
            "CUDA_VISIBLE_DEVICES)")


def check_data_args(data_args: DataArguments, training_args: TrainingArguments) -> None:
    """Refuse combinations the data path cannot honour, before anything is read."""
    if not 0 <= data_args.validation_split_percentage < 100:
        raise ValueError(f"--validation_split_percentage {data_args.validation_split_percentage:g}: must be at least 0 "
                         "and below 100 (the percentage of the training documents held out)")
    if data_args.block_size < 2:
        raise ValueError(f"--block_size must be >= 2 (BOS + at least one token), got {data_args.block_size}")
    for name in ("max_train_samples", "max_eval_samples"):
        value = getattr(data_args, name)
        if value is not None and value < 1:  # 0 would be read as "no limit"
            raise ValueError(f"--{name} must be >= 1 (blocks to keep), got {value}; leave it out to keep every block")
    if data_args.perplexity_max_tokens is not None and data_args.perplexity_max_tokens < 1:
        raise ValueError(f"--perplexity_max_tokens must be >= 1, got {data_args.perplexity_max_tokens}; leave it out "
                         "for the default (about the training's cost)")
    if data_args.perplexity_positions_per_window < 0:
        raise ValueError("--perplexity_positions_per_window must be >= 0 (0: every position), got "
                         f"{data_args.perplexity_positions_per_window}")
    if data_args.shuffle_buffer_size < 0:
        raise ValueError(f"--shuffle_buffer_size must be >= 0 (0: stream order), got {data_args.shuffle_buffer_size}")
    if not data_args.streaming:
        return
    if getattr(training_args, "dataloader_workers_by_default", False):
        # a stream's blocks depend on the number of workers (each packs its own files) and N workers need
        # N files per rank: a stream is read in the main process unless --dataloader_num_workers says otherwise
        training_args.dataloader_num_workers = 0
        training_args.dataloader_persistent_workers = False
    if data_args.preprocessing_num_workers:
        raise ValueError(
            "--streaming tokenizes on the fly, in the data loader: --preprocessing_num_workers (map num_proc) does "
            "not apply. Use --dataloader_num_workers N to tokenize in N worker processes"
        )
    if training_args.do_train and training_args.max_steps <= 0:
        raise ValueError("--streaming: a stream has no known length, so epochs cannot be counted; give --max_steps")
    if training_args.do_eval and not data_args.validation_files and not data_args.dataset_name:
        raise ValueError(
            "--streaming cannot hold out --validation_split_percentage of a stream of unknown length: give "
            "--validation_files, or train only (--do_train without --do_eval)"
        )


def _train_source(data_args: DataArguments) -> list[str]:
    source = data_args.train_files or ([data_args.dataset_name] if data_args.dataset_name else [])
    if not source:
        raise ValueError("give training data: --train_files FILES_OR_FOLDERS or --dataset_name NAME")
    return source


def read_splits(data_args: DataArguments):
    """Training and validation text datasets (``Dataset``, or ``IterableDataset`` with ``--streaming``); the
    validation one is None when there is none. Nothing is read into Python lists."""
    source = _train_source(data_args)
    load = dict(text_column=data_args.text_column, streaming=data_args.streaming, cache_dir=data_args.cache_dir,
                config_name=data_args.dataset_config_name)
    train = load_text_dataset(source, split="train", **load)
    if data_args.validation_files:
        return train, load_text_dataset(data_args.validation_files, split="validation", **load)
    if data_args.dataset_name and not data_args.train_files:
        try:
            return train, load_text_dataset(source, split="validation", **load)
        except ValueError:
            if data_args.streaming:
                raise ValueError(
                    f"--streaming: dataset {data_args.dataset_name!r} has no validation split, and a stream of unknown "
                    "length cannot be held out from: give --validation_files, or train only (--do_train)"
                ) from None
    if data_args.streaming:
        return train, None
    # hold out the last documents: deterministic, and no document is split between the two sets
    held = int(round(len(train) * data_args.validation_split_percentage / 100))
    if held == 0:
        return train, None
    if held >= len(train):
        raise ValueError(f"--validation_split_percentage {data_args.validation_split_percentage} leaves no training documents")
    return train.select(range(len(train) - held)), train.select(range(len(train) - held, len(train)))


def perplexity_documents(eval_raw, data_args: DataArguments, seed: int) -> list[str]:
    """The validation documents the end-of-run perplexity reads: ``--perplexity_max_documents`` of them, a seeded
    random sample in file order (a stream's first ones)."""
    import datasets

    if isinstance(eval_raw, datasets.Dataset):
        eval_raw = seeded_sample(eval_raw, data_args.perplexity_max_documents, seed, what="validation documents",
                                 flag="--perplexity_max_documents", keep_order=True)
    return list(iter_dataset_texts(eval_raw, data_args.text_column, max_documents=data_args.perplexity_max_documents))


def rows_as_numpy(blocks):
    """Map-style blocks read as numpy rows (``with_format("numpy")``); streams and ``None`` pass through.

    The data loader then fetches arrays from Arrow instead of Python lists, and the collator pads arrays:
    both several times faster (``benchmarks/collator_bench.py``), with the same plans."""
    import datasets

    return blocks.with_format("numpy") if isinstance(blocks, datasets.Dataset) else blocks


def build_training_data(data_args: DataArguments, training_args: TrainingArguments, tokenizer, train_raw, eval_raw):
    """Tokenized, packed blocks for training and evaluation.

    Map-style: cached Arrow datasets, built once per node (the local main process first, the others then
    load its cache). Streaming: lazy ``IterableDataset``s; the training stream is truncated to
    ``--max_train_samples`` blocks, repeated without end, shuffled in a buffer (seeded, the same on every
    rank), then split across ranks with ``split_dataset_by_node``."""
    block_size = data_args.block_size
    main = training_args.process_index == 0  # one data summary in the log, not one per process
    common = dict(text_column=data_args.text_column, num_proc=data_args.preprocessing_num_workers,
                  load_from_cache_file=not data_args.overwrite_cache, log=main)
    with training_args.main_process_first(desc="tokenizing and packing"):
        train_blocks, _ = build_blocks(train_raw, tokenizer, block_size, what="training data", **common)
        eval_blocks = None
        if eval_raw is not None:
            eval_blocks, _ = build_blocks(eval_raw, tokenizer, block_size, what="validation data", **common)
    if data_args.streaming:
        if data_args.max_train_samples:
            train_blocks = train_blocks.take(data_args.max_train_samples)
        # this rank's first block, read before the shuffle buffer would fill: an empty part is an error now
        own = split_for_rank(train_blocks, training_args.process_index, training_args.world_size)
        if next(iter(own), None) is None:
            raise ValueError(
                f"--streaming: process {training_args.process_index} of {training_args.world_size} got no block of "
                f"{block_size} tokens from the training data: give more text, a smaller --block_size or fewer processes"
            )
        # an endless stream (pass after pass): every rank has a batch at every one of the max_steps steps,
        # even when the ranks' parts differ in length (a rank that ran out would hang the others), and a
        # resumed run can skip to any step, not only within the first pass
        train_blocks = train_blocks.repeat(None)
        if data_args.shuffle_buffer_size > 0:
            train_blocks = train_blocks.shuffle(seed=training_args.seed, buffer_size=data_args.shuffle_buffer_size)
        if eval_blocks is not None and data_args.max_eval_samples:
            eval_blocks = eval_blocks.take(data_args.max_eval_samples)
        # each rank reads its own part; evaluation streams are split by accelerate
        train_blocks = split_for_rank(train_blocks, training_args.process_index, training_args.world_size)
        return train_blocks, eval_blocks
    # a seeded random sample of blocks, in file order (the first N blocks would be the first documents only)
    train_blocks = seeded_sample(train_blocks, data_args.max_train_samples, training_args.seed,
                                 what="training blocks", flag="--max_train_samples", keep_order=True)
    if eval_blocks is not None:
        eval_blocks = seeded_sample(eval_blocks, data_args.max_eval_samples, training_args.seed,
                                    what="validation blocks", flag="--max_eval_samples", keep_order=True)
    if main:
        logger.info("%d training blocks of %d tokens; %s validation blocks", len(train_blocks), block_size,
                    len(eval_blocks) if eval_blocks is not None else 0)
    return train_blocks, eval_blocks


def cut_to_tokens(texts: list[str], tokenizer, max_tokens: int) -> list[str]:
    """Whole documents while they fit in ``max_tokens``; the first document that does not is cut to the tokens
    left (at least one document is kept). The caller logs what was kept."""
    kept, used = [], 0
    for text in texts:
        # verbose=False: a document longer than model_max_length is expected (perplexity cuts it into windows)
        n = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if used + n <= max_tokens:
            kept.append(text)
            used += n
            continue
        left = max_tokens - used
        if left > 0 or not kept:  # the characters of the share of tokens left: about that many tokens
            kept.append(text[: max(1, len(text) * max(left, 1) // max(n, 1))])
        break
    return kept


def perplexity_token_limit(data_args: DataArguments, training_args: TrainingArguments, steps: int,
                           rows_per_window: int) -> tuple[int | None, str]:
    """The validation tokens the end-of-run perplexity scores at most, and why (for the log).

    ``--perplexity_max_tokens`` when given. Otherwise about the training's own cost: a training step is a forward
    and a backward (about 3 forward rows) of each block of the global batch, and a scored window costs
    ``rows_per_window`` forward rows and moves on by a stride of half a block. ``--max_eval_samples`` (blocks)
    bounds it too."""
    if data_args.perplexity_max_tokens is not None:
        return data_args.perplexity_max_tokens, "--perplexity_max_tokens"
    limits = []
    if steps > 0:
        rows = 3 * steps * training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps \
            * max(1, training_args.world_size)
        windows = max(1, rows // rows_per_window)
        limits.append((windows * max(1, data_args.block_size // 2), f"about the cost of the {steps} training steps"))
    if data_args.max_eval_samples:
        limits.append((data_args.max_eval_samples * data_args.block_size,
                       f"--max_eval_samples {data_args.max_eval_samples} blocks"))
    return min(limits) if limits else (None, "")


def final_perplexity(model, tokenizer, texts, objective_args: ObjectiveArguments, block_size: int, batch_size: int,
                     positions_per_window: int | None = 16, progress: bool = True, token_limit=None):
    """``p(x_k | x_<k)`` on held-out documents with the protocol of hf_lookaround.evaluation.perplexity.

    The per-prefix protocol of masked/GVP checkpoints runs one forward row per scored position: by default 16
    evenly spaced prefix lengths of each window are scored (``positions_per_window``; None or 0: all); the log
    says how many of how many. ``token_limit(rows_per_window)`` gives the tokens to score at most, and why
    (:func:`perplexity_token_limit`): the documents are cut to them."""
    from ..evaluation.perplexity import ar_perplexity, default_masked_mode, masked_perplexity

    causal = objective_args.single_stream_head == objectives.CAUSAL_HEAD
    per_prefix = not causal and default_masked_mode(model) != "two_stream"
    if token_limit is not None:
        max_tokens, why = token_limit((positions_per_window or block_size) if per_prefix else 1)
        if max_tokens is not None:
            total = len(texts)
            texts = cut_to_tokens(texts, tokenizer, max_tokens)
            logger.info("end-of-run perplexity: %d of %d validation document(s), at most %d tokens (%s; "
                        "--perplexity_max_tokens sets it)", len(texts), total, max_tokens, why)
    if is_block_diffusion_model(model.config):  # bd3lm's x_t ⊕ x_0 has no prefix view: its bound, the ELBO
        from ..evaluation.perplexity import elbo_perplexity

        was_training = model.training
        model.eval()
        try:
            result = elbo_perplexity(model, tokenizer, texts, max_length=block_size, stride=max(1, block_size // 2),
                                     batch_size=batch_size)
        finally:
            model.train(was_training)
        return {"eval_elbo_perplexity": result.perplexity, "eval_bits_per_byte": result.bits_per_byte}
    if causal:  # GPT, or dar's one-stream form (t forwards)
        result = ar_perplexity(model, tokenizer, texts, max_length=block_size, stride=max(1, block_size // 2),
                               batch_size=batch_size)
        return {"eval_ar_perplexity": result.perplexity, "eval_bits_per_byte": result.bits_per_byte}
    # auto: the AR plan for (semi-)AR checkpoints, the bidirectional prefix for masked/GVP ones,
    # [MASK] inputs for single-stream masked LMs (see evaluation.perplexity.default_masked_mode)
    mode = "auto"
    per_window = positions_per_window or None
    if per_prefix and per_window is not None:
        logger.info("masked perplexity at the end: %d evenly spaced prefix lengths of each %d-token window of %d "
                    "document(s) (--perplexity_positions_per_window; 0 scores every position, %dx the work)",
                    per_window, block_size, len(texts), max(1, block_size // per_window))
    was_training = model.training
    model.eval()
    try:
        result = masked_perplexity(model, tokenizer, texts, max_length=block_size, stride=max(1, block_size // 2),
                                   batch_size=batch_size, mode=mode, positions_per_window=per_window,
                                   progress=progress)
    finally:
        model.train(was_training)
    if "num_scorable_tokens" in result.extra:
        logger.info("masked perplexity: scored %d of %d positions", result.num_tokens, result.extra["num_scorable_tokens"])
    masked = objectives.family(objective_args.objective) == objectives.MASKED
    name = "eval_masked_perplexity" if masked else "eval_ar_perplexity"
    return {name: result.perplexity, "eval_bits_per_byte": result.bits_per_byte}


def card_kwargs(objective_args: ObjectiveArguments, dataset, eval_dataset=None) -> dict:
    return {"objective": objective_args.objective, "plan_params": objective_args.plan_params(), "dataset": dataset,
            "eval_dataset": eval_dataset}


def eval_data_name(data_args: DataArguments) -> str | None:
    """What the eval_* results of a run were measured on, in words, for its model card."""
    if data_args.validation_files:
        return ", ".join(str(f) for f in data_args.validation_files)
    if data_args.dataset_name and not data_args.train_files:
        return f"{data_args.dataset_name} (validation split)"
    if data_args.validation_split_percentage:
        return (f"the last {data_args.validation_split_percentage:g} % of the documents of "
                f"{', '.join(str(f) for f in data_args.train_files)} (held out from training)")
    return None


def write_card(output_dir, objective_args: ObjectiveArguments, dataset, eval_dataset=None) -> None:
    from ..hub.cards import write_model_card

    write_model_card(output_dir, **card_kwargs(objective_args, dataset, eval_dataset))


def save_final_model(trainer, objective_args: ObjectiveArguments, data_args: DataArguments) -> None:
    """The final model at the top of ``output_dir``, written as a unit as a checkpoint is, before any scoring:
    the old marker goes first (from here the folder is unfinished, and the package's loaders refuse it), then
    weights, config, trainer state, card and every head's ``auto_map``, and the marker last."""
    output_dir = trainer.args.output_dir
    if trainer.is_world_process_zero():
        (Path(output_dir) / checkpointing.FINAL_MARKER).unlink(missing_ok=True)
    trainer.save_model()
    trainer.save_state()
    if not trainer.is_world_process_zero():
        return
    dataset = data_args.dataset_name or [str(f) for f in data_args.train_files]
    write_card(output_dir, objective_args, dataset, eval_data_name(data_args))
    from ..hub.remote_code import ensure_remote_code

    # save_model maps only the trained head in auto_map: map every head, so that the output loads as a
    # causal or masked LM with trust_remote_code too
    ensure_remote_code(output_dir)
    # last, once config.json has its auto_map: a rerun checks the final model against this record
    checkpointing.mark_final_model(output_dir, trainer.state.global_step)


# ---------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------


def run(model_args: ModelArguments, data_args: DataArguments, objective_args: ObjectiveArguments,
        training_args: TrainingArguments, callbacks: list | None = None) -> dict:
    """Pretrain; return the final metrics. ``callbacks``: more ``TrainerCallback``s for the Trainer (a benchmark's
    step timer, for example).

    The main process holds ``output_dir``'s lock for the whole run (a second writer is refused), and a new
    training run in an occupied ``output_dir`` is refused (see :func:`checkpointing.check_output_dir`)."""
    lock = None
    if training_args.process_index == 0:
        lock = checkpointing.OutputDirLock(training_args.output_dir).acquire()
    try:
        if training_args.process_index == 0 and training_args.do_train:
            checkpointing.check_output_dir(training_args.output_dir, training_args.resume_from_checkpoint,
                                           getattr(training_args, "overwrite_output_dir", False))
        from ..adaptation import prepare_init

        # the init step: --init_from (a causal LM converted on the fly) and --lora_r (merged when training ends)
        callbacks = prepare_init(model_args, training_args, callbacks or [])
        return _run(model_args, data_args, objective_args, training_args, callbacks)
    finally:
        if lock is not None:
            lock.release()


def _run(model_args: ModelArguments, data_args: DataArguments, objective_args: ObjectiveArguments,
         training_args: TrainingArguments, callbacks: list) -> dict:
    """The run, in order: check the arguments, read the text and build the tokenizer, config and blocks
    (:func:`_prepare`), assemble the Trainer (:func:`build_trainer`), decide what the output folder's checkpoints
    leave to do (:func:`checkpointing.decide_resume`), train or save the final model, evaluate, push."""
    if not (training_args.do_train or training_args.do_eval):
        raise ValueError("nothing to do: pass --do_train and/or --do_eval (with neither, no stage would run)")
    if training_args.do_train and training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise ValueError(f"nothing to train: --max_steps {training_args.max_steps} and --num_train_epochs "
                         f"{training_args.num_train_epochs:g}; give a positive --max_steps or --num_train_epochs")
    set_seed(training_args.seed)
    apply_global_batch_size(training_args)
    block_size = data_args.block_size
    check_launch(training_args)
    check_data_args(data_args, training_args)
    objective_args.check_block_size(block_size)
    tokenizer, config, train_blocks, eval_blocks, eval_texts = _prepare(model_args, data_args, objective_args,
                                                                         training_args)
    trainer = build_trainer(config, model_args, objective_args, training_args, tokenizer, train_blocks, eval_blocks,
                            block_size=block_size, callbacks=callbacks, run_settings={"block_size": block_size})
    from ..adaptation import check_lora_trainer

    check_lora_trainer(trainer)  # --lora_r under a setup its adapters cannot run in (FSDP1): one line
    checkpointing.check_sharded_saving(trainer)  # SHARDED_STATE_DICT under FSDP1: one line

    metrics: dict = {}
    decision = checkpointing.decide_resume(training_args, trainer.model.config, trainer.run_settings)
    if decision.action == checkpointing.FINISHED:
        # a finished run (a requeued job with `last`): nothing is trained or written again
        logger.info("%s is the end of this training (step %d): nothing to train; the final model is saved",
                    decision.checkpoint, checkpointing.trainer_state_step(decision.checkpoint))
        results = Path(training_args.output_dir) / "all_results.json"
        if results.is_file():
            metrics.update(load_json_file(results))  # a cut file is named
        if not training_args.do_eval or (Path(training_args.output_dir) / "eval_results.json").is_file():
            return metrics
        trainer._load_from_checkpoint(training_args.output_dir)  # evaluate the final weights
    elif decision.action == checkpointing.SAVE_FINAL:
        _save_final_model_again(trainer, decision.checkpoint, objective_args, data_args, training_args)
    elif training_args.do_train:
        result = trainer.train(resume_from_checkpoint=decision.checkpoint)
        metrics.update(result.metrics)
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        save_final_model(trainer, objective_args, data_args)
    if training_args.do_eval:
        eval_metrics = trainer.evaluate()
        steps = trainer.state.global_step or max(training_args.max_steps, 0)
        eval_metrics.update(final_perplexity(
            trainer.model, tokenizer, eval_texts, objective_args, block_size,
            training_args.per_device_eval_batch_size, data_args.perplexity_positions_per_window,
            progress=not training_args.disable_tqdm,
            token_limit=lambda rows: perplexity_token_limit(data_args, training_args, steps, rows),
        ))
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    dataset = data_args.dataset_name or [str(f) for f in data_args.train_files]
    if trainer.is_world_process_zero() and (Path(training_args.output_dir) / "config.json").is_file():
        # the card again, now that all_results.json holds the end-of-run scores (README.md is outside the marker)
        write_card(training_args.output_dir, objective_args, dataset, eval_data_name(data_args))
    if training_args.push_to_hub:
        from ..hub.push import push_trainer_output

        # not trainer.push_to_hub(): that replaces our card and maps only the saved head in auto_map
        push_trainer_output(trainer, **card_kwargs(objective_args, dataset, eval_data_name(data_args)))
    return metrics


def _prepare(model_args: ModelArguments, data_args: DataArguments, objective_args: ObjectiveArguments,
             training_args: TrainingArguments):
    """The text of the run, read once: the tokenizer, the config (checked before the data is built), the training
    and evaluation blocks, and the documents scored with the p(x_k | x_<k) protocol at the end."""
    block_size = data_args.block_size
    with training_args.main_process_first(desc="loading the text"):
        train_raw, eval_raw = read_splits(data_args)
    if training_args.do_eval and eval_raw is None:
        if data_args.streaming:
            why = "a stream cannot be held out from"
        else:  # the percentage of the training documents rounded to none (a .txt file is one document)
            why = (f"--validation_split_percentage {data_args.validation_split_percentage:g} of {len(train_raw)} "
                   "training document(s) holds out none (a .txt file is one document)")
        raise ValueError(f"--do_eval needs validation data, and {why}: give --validation_files, more documents "
                         "or a larger --validation_split_percentage, or train only (--do_train)")
    tokenizer = prepare_tokenizer(model_args, data_args, training_args, train_raw, block_size)
    check_tokenizer(tokenizer, objective_args)
    config = build_config(model_args, objective_args, tokenizer, block_size)  # checked before the data is built

    train_blocks, eval_blocks = build_training_data(data_args, training_args, tokenizer, train_raw, eval_raw)
    train_blocks, eval_blocks = rows_as_numpy(train_blocks), rows_as_numpy(eval_blocks)
    # the tokenizer saved beside the model says the trained length too (transformers' and lm-eval's reading of it);
    # set after the data is built: packing and perplexity read longer documents on purpose
    tokenizer.model_max_length = block_size
    # the documents scored with the p(x_k | x_<k) protocol at the end (a few, read one by one)
    eval_texts = [] if eval_raw is None or not training_args.do_eval else perplexity_documents(
        eval_raw, data_args, training_args.seed)
    return tokenizer, config, train_blocks, eval_blocks, eval_texts


def _save_final_model_again(trainer, checkpoint, objective_args: ObjectiveArguments, data_args: DataArguments,
                            training_args: TrainingArguments) -> None:
    """The run was killed between its last checkpoint (the end of the training) and the final save, or its final
    model is damaged: save the checkpoint's weights (or, with --load_best_model_at_end, the best checkpoint's)
    as the final model again, training nothing."""
    trainer.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
    source = checkpoint
    best = trainer.state.best_model_checkpoint
    if training_args.load_best_model_at_end and best:  # the final model is the best checkpoint's
        if not Path(best).is_dir() or checkpointing.checkpoint_problems(best):
            raise ValueError(f"the final model of {training_args.output_dir} is the best checkpoint {best} "
                             "(--load_best_model_at_end), which is missing or damaged: it cannot be written again")
        source = best
    logger.info("%s is the end of this training: saving %s as the final model, training nothing", checkpoint,
                "it" if source == checkpoint else f"the best checkpoint {source}")
    trainer._load_from_checkpoint(source)
    from ..adaptation import merge_lora

    merge_lora(trainer.model)  # a LoRA run's final model is merged, as at the end of its training
    save_final_model(trainer, objective_args, data_args)
