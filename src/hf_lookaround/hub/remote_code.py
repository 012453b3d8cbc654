"""Remote code: a user without this package loads a checkpoint with
``AutoModel*.from_pretrained(repo, trust_remote_code=True)``; transformers then downloads the
modules named in ``config.json["auto_map"]`` and, recursively, the files they import with
``from .module import ...`` (the only relative form it follows). :func:`ensure_remote_code` makes
sure those files are all there and that none imports ``hf_lookaround`` itself.
"""

from __future__ import annotations

import ast
import json
import logging
import shutil
from pathlib import Path

from .files import read_json, write_text

logger = logging.getLogger(__name__)

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



def _package_module_files(model_module: str = MODEL_MODULE) -> list[Path]:
    """The modules a checkpoint needs for trust_remote_code, as transformers' custom_object_save copies them."""
    import importlib

    from transformers.dynamic_module_utils import get_relative_import_files

    model_file = Path(importlib.import_module(f"hf_lookaround.models.lookaround.{model_module}").__file__)
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
    config = read_json(config_path)
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
        write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    return written
