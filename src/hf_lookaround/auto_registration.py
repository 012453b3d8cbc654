"""Register the LookAround classes with transformers' Auto classes, lazily.

``import hf_lookaround`` must stay cheap (the CLI's ``--help`` answers in well under a second), so it
imports neither torch nor transformers. Registration therefore waits for the moment it is needed:

- the configs (``AutoConfig``) are registered as soon as ``transformers.models.auto.configuration_auto``
  or a LookAround configuration module is imported;
- a family's models (``AutoModel``, ``AutoModelForPreTraining``, ...) are registered as soon as
  ``transformers.models.auto.modeling_auto`` (what ``AutoModel*`` and ``pipeline`` import) or the
  family's modeling module is imported.

A small ``sys.meta_path`` finder runs the registration right after those modules finish importing
(a post-import hook). Modules already imported when ``hf_lookaround`` is imported are handled at once.
So ``import hf_lookaround; AutoModel.from_pretrained(lookaround_checkpoint)`` works as before, and
``save_pretrained`` still writes ``auto_map`` and the modeling code for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

# family -> (configuration module, config class, {Auto class: (modeling module, model class)})
FAMILIES = {
    "text": ("configuration_lookaround", "LookAroundConfig", {
        "AutoModel": ("modeling_lookaround", "LookAroundModel"),
        "AutoModelForPreTraining": ("modeling_lookaround", "LookAroundForPreTraining"),
        "AutoModelForMaskedLM": ("modeling_lookaround", "LookAroundForMaskedLM"),
        "AutoModelForCausalLM": ("modeling_lookaround", "LookAroundForCausalLM"),
        "AutoModelForSequenceClassification": ("modeling_lookaround", "LookAroundForSequenceClassification"),
    }),
    "vit": ("configuration_lookaround_vit", "LookAroundViTConfig", {
        "AutoModel": ("modeling_lookaround_vit", "LookAroundViTModel"),
        "AutoModelForPreTraining": ("modeling_lookaround_vit", "LookAroundViTForPreTraining"),
        "AutoModelForImageClassification": ("modeling_lookaround_vit", "LookAroundViTForImageClassification"),
    }),
}
# family -> (module, class) of its image processor
IMAGE_PROCESSORS = {"vit": ("image_processing_lookaround_vit", "LookAroundViTImageProcessor")}
_PACKAGE = __name__.rpartition(".")[0]
_BUNDLE = _PACKAGE + ".models.lookaround"  # the remote-code files of both families
_requested: set[str] = set()  # "config" and family names asked for
_done: set[str] = set()  # ... and registered
_flushing = False


def _still_importing(module: str) -> bool:
    spec = getattr(sys.modules.get(module), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _package_busy(finishing: str | None) -> bool:
    """True while a module of this package is executing: its classes may not exist yet (circular imports).
    ``finishing``: the module whose last statement just ran (still flagged as importing)."""
    return any(name.startswith(_PACKAGE + ".") and name != finishing and _still_importing(name)
               for name in list(sys.modules))


def _flush(finishing: str | None = None) -> None:
    """Do the requested registrations, unless a package module is mid-import (then it flushes when done)."""
    global _flushing
    if _flushing or _package_busy(finishing):
        return
    _flushing = True
    try:
        while _requested - _done:
            what = min(_requested - _done)  # "config" sorts before the families
            _done.add(what)
            _register_configs() if what == "config" else _register_models(what)
    finally:
        _flushing = False


def _register_configs() -> None:
    from transformers import AutoConfig

    for module, config_name, _ in FAMILIES.values():
        config = getattr(importlib.import_module(f"{_BUNDLE}.{module}"), config_name)
        AutoConfig.register(config.model_type, config, exist_ok=True)
        config.register_for_auto_class()  # save_pretrained writes auto_map and copies the code


def _register_models(family: str) -> None:
    import transformers

    config_module, config_name, heads = FAMILIES[family]
    config = getattr(importlib.import_module(f"{_BUNDLE}.{config_module}"), config_name)
    for auto_name, (module, model_name) in heads.items():
        model = getattr(importlib.import_module(f"{_BUNDLE}.{module}"), model_name)
        getattr(transformers, auto_name).register(config, model, exist_ok=True)
        # a process that never imported this package loads any head with trust_remote_code=True
        model.register_for_auto_class(auto_name)
    if family in IMAGE_PROCESSORS:  # AutoImageProcessor and the image pipelines find the family's processor
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        processor = getattr(importlib.import_module(f"{_BUNDLE}.{IMAGE_PROCESSORS[family][0]}"),
                            IMAGE_PROCESSORS[family][1])
        AutoImageProcessor.register(config, image_processor_classes={"pil": processor}, exist_ok=True)
        processor.register_for_auto_class()
        # image pipelines also look for a video processor: from the image processor's auto_map transformers derives
        # one (LookAroundViTVideoProcessor) that exists nowhere, and, finding no local video processor for the
        # config, asks on stdin whether to run the repo's code ("[y/N]", 15 s). Registering "none" for the config
        # tells it the local code is known: no prompt, and no video processor (there is none to find)
        from transformers.models.auto.video_processing_auto import AutoVideoProcessor

        AutoVideoProcessor.register(config, None, exist_ok=True)


def register_configs() -> None:
    """``AutoConfig.register`` for every LookAround config (imports transformers' configuration code only)."""
    _requested.add("config")
    _flush()


def register_models(family: str) -> None:
    """Register one family's configs and model classes with their Auto classes (imports its modeling code)."""
    _requested.update(("config", family))
    _flush()


def register_all() -> None:
    _requested.update(("config", *FAMILIES))
    _flush()


# module name -> what to register once it has been imported
TRIGGERS = {
    "transformers.models.auto.configuration_auto": {"config"},
    "transformers.models.auto.modeling_auto": {"config", *FAMILIES},
    "transformers.models.auto.image_processing_auto": {"config", *IMAGE_PROCESSORS},
    **{f"{_BUNDLE}.{config_module}": {"config"} for config_module, _, _ in FAMILIES.values()},
    **{f"{_BUNDLE}.{module}": {"config", family}
       for family, (_, _, heads) in FAMILIES.items() for module, _ in heads.values()},
}


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loaders of trigger modules (and of this package's modules) so that
    registration follows their import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TRIGGERS and not fullname.startswith(_PACKAGE + "."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            # a trigger asks for its registration; any module of the package, once executed, runs what
            # was put off while it was importing (its imports reached a trigger mid-way)
            _requested.update(TRIGGERS.get(fullname, ()))
            _flush(finishing=fullname)

        spec.loader.exec_module = exec_then_register  # this module's loader instance only
        return spec


def install() -> None:
    """Called by ``hf_lookaround/__init__``: register now what is already imported, the rest on import."""
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
    for name, requests in TRIGGERS.items():
        if name in sys.modules:
            _requested.update(requests)
    _flush()
