"""Check a checkpoint before anything loads or pushes it: its weights files are present, listed in the index and
valid safetensors (:func:`check_weights`); it is a checkpoint of the kind the command reads (text or vision,
:func:`checkpoint_kind`); its tensors are the ones its config.json describes, with the same shapes
(:func:`check_tensors`); and they hold no NaN or infinity (``check_finite``: the one ``from_pretrained`` itself runs,
from ``models/lookaround/loading_lookaround.py``). :func:`check_local_checkpoint` runs them all;
``load.load_checkpoint`` is the one loader the commands use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

# check_finite is the bundle's (from_pretrained runs it); load.py takes it from here
from ..models.lookaround.loading_lookaround import INCOMPLETE_WEIGHTS, check_finite, listed  # noqa: F401
from .files import read_json, unfinished_run

logger = logging.getLogger(__name__)

WEIGHTS_NAME, WEIGHTS_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
# accelerate's folder of model shards in a checkpoint saved under FSDP's SHARDED_STATE_DICT (FSDP_MODEL_NAME, index 0)
SHARDED_MODEL_DIR = "pytorch_model_fsdp_0"


def _check_safetensors(path: Path, where: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = list(f.keys())
    except PermissionError:
        raise ValueError(f"{path.name} in {where} cannot be read: permission denied; give this user read access "
                         f"(chmod +r {path})") from None
    except Exception as err:  # safetensors raises its own error type; name the file instead
        if not os.access(path, os.R_OK):
            raise ValueError(f"{path.name} in {where} cannot be read: permission denied; give this user read access "
                             f"(chmod +r {path})") from None
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
    if unfinished_run(folder):
        raise ValueError(unfinished_run(folder))
    index = folder / WEIGHTS_INDEX_NAME
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif index.is_file():
        data = read_json(index)
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
        if (folder / SHARDED_MODEL_DIR).is_dir():  # a checkpoint of a run under FSDP's SHARDED_STATE_DICT
            hint = (f" (it holds FSDP shards, {SHARDED_MODEL_DIR}/: resume from it, or write them as one file with "
                    f"`accelerate merge-weights {folder / SHARDED_MODEL_DIR} {folder}`)")
        raise ValueError(f"no weights in {where}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}{hint}")
    for path in files:
        _check_safetensors(path, where)
    return files


# config.json's model_type -> what a LookAround checkpoint holds
LOOKAROUND_KINDS = {"lookaround": "text", "lookaround_vit": "vision"}
# what reads each kind, for the message that refuses a checkpoint of another kind
READ_BY = {"text": "hf-lookaround generate, perplexity, probe or glue",
           "vision": "hf-lookaround vision sample --model DIR"}


def checkpoint_kind(folder) -> str:
    """``"text"`` or ``"vision"`` for a LookAround checkpoint, ``"other"`` for a model of another type. A
    config.json that names LookAround classes under another model_type (an edited config) is refused: neither
    the package nor transformers would read it as saved."""
    folder = Path(folder)
    config = read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{folder} is not a model checkpoint: it holds no readable config.json "
                         "(save the model with save_pretrained)")
    model_type = config.get("model_type")
    if model_type in LOOKAROUND_KINDS:
        return LOOKAROUND_KINDS[model_type]
    ours = [a for a in config.get("architectures") or [] if str(a).startswith("LookAround")]
    if ours or "plan_params" in config:
        raise ValueError(f"{folder} is not an hf_lookaround checkpoint as saved: its config.json has model_type "
                         f"{model_type!r} but LookAround fields ({listed(ours) or 'plan_params'}); restore the "
                         "config.json saved with the weights (model_type 'lookaround' or 'lookaround_vit')")
    return "other"


def check_kind(folder, command: str, kinds=("text",)) -> str:
    """:func:`checkpoint_kind`, refused with one line unless it is one of ``kinds`` (which command reads it)."""
    kind = checkpoint_kind(folder)
    if kind in kinds:
        return kind
    if kind == "other":
        model_type = (read_json(Path(folder) / "config.json") or {}).get("model_type")
        raise ValueError(f"{folder} is not an hf_lookaround checkpoint (config.json's model_type is {model_type!r}, "
                         f"not 'lookaround'): {command} reads checkpoints saved by hf-lookaround "
                         "pretrain or vision")
    raise ValueError(f"{folder} is a {kind} checkpoint, which {command} does not read: use "
                     f"{READ_BY[kind].replace('DIR', str(folder))}")


def _stored_shapes(files) -> dict[str, tuple]:
    from safetensors import safe_open

    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _tensor_problems(cls, config, stored: dict) -> tuple[int, list[str]]:
    """How many tensors differ between ``stored`` (name -> shape) and ``cls(config)``'s, and how."""
    import torch

    with torch.device("meta"):
        model = cls(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # lm_head.weight -> embed_tokens.weight: saved once
    # a tied pair is saved once, under either name
    saved_as = {**tied, **{source: target for target, source in tied.items()}}
    missing = [k for k in expected if k not in stored and saved_as.get(k) not in stored and k not in tied]
    unexpected = [k for k in stored if k not in expected]
    changed = [f"{k} {list(stored[k])} (config.json: {list(expected[k])})"
               for k in stored if k in expected and stored[k] != expected[k]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing ({listed(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) ({listed(unexpected)})")
    if changed:
        problems.append(f"{len(changed)} tensor(s) of another shape: {listed(changed, 2)}")
    return len(missing) + len(unexpected) + len(changed), problems


def _head_classes(config) -> list:
    """The LookAround classes to compare a checkpoint with: its ``architectures`` class, or (none recorded: an
    edited or hand-written config.json) every head of its model_type, since any of them may have saved it."""
    import importlib

    from .remote_code import REMOTE_CODE

    if config.model_type not in REMOTE_CODE:
        return []
    module = importlib.import_module(f"hf_lookaround.models.lookaround.{REMOTE_CODE[config.model_type][2]}")
    name = (config.architectures or [""])[0]
    if name.startswith("LookAround"):
        return [c for c in [getattr(module, name, None)] if c is not None]
    if name:
        return []
    return [getattr(module, cls) for _, cls in REMOTE_CODE[config.model_type][3].values()]


def check_tensors(folder, files) -> None:
    """The tensors in ``files`` must be those of the model that ``folder``'s config.json describes (its
    ``architectures`` class, built on the meta device: no memory; without one, the head of its model_type that
    matches best), with the same shapes. ``from_pretrained`` would re-initialise missing tensors and drop
    unexpected ones with a warning, and stop on a changed shape with a traceback that suggests
    ``ignore_mismatched_sizes`` (which re-initialises them too)."""
    import transformers

    folder = Path(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    classes = _head_classes(config)
    if not classes:  # not a LookAround class: nothing to compare with
        return
    stored = _stored_shapes(files)
    found = [(cls, _tensor_problems(cls, config, stored)) for cls in classes]
    if any(count == 0 for _, (count, _) in found):
        return
    cls, (_, problems) = min(found, key=lambda pair: pair[1][0])  # the head that matches best
    hint = INCOMPLETE_WEIGHTS
    if any("another shape" in p for p in problems):
        saved = read_json(folder / "config.json") or {}
        absent = [k for k in type(config)().to_diff_dict() if k not in saved and k != "transformers_version"]
        removed = f" (config.json lacks {listed(absent)}: removed fields take their defaults)" if absent else ""
        hint = f"Its config.json and the weights do not belong together{removed}; restore the config.json saved with them"
    raise ValueError(f"the weights in {folder} do not match its config.json ({cls.__name__}): "
                     f"{'; '.join(problems)}. {hint}")


def stored_tensors(files):
    """``(name, tensor)`` for every tensor of the safetensors ``files``, one at a time."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def check_local_checkpoint(model_name_or_path, command: str, kinds=("text",), finite: bool = False) -> None:
    """Every check of this module on a local checkpoint folder, before anything loads it: its kind (one of
    ``kinds``; ``"other"``: a model of another type, whose tensors are left to ``from_pretrained``), its weights
    files, its tensors against config.json and, with ``finite``, their values (a loader checks the loaded model's
    instead: :func:`load.load_checkpoint`). A Hub name is left to ``from_pretrained``."""
    folder = Path(model_name_or_path)
    if not folder.is_dir():
        return
    kind = check_kind(folder, command, kinds)
    files = check_weights(folder)
    if kind != "other":
        check_tensors(folder, files)
    if finite:
        check_finite(stored_tensors(files), str(folder))
