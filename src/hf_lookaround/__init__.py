"""hf_lookaround: autoregressive, masked and group-rank objectives on one two-stream transformer.

The package is lazy, as transformers is: ``import hf_lookaround`` imports neither torch nor
transformers, and each name below is imported on first use (module ``__getattr__``). The Auto
classes still know the LookAround configs and models: :mod:`.auto_registration` registers them as
soon as transformers' Auto machinery (or a LookAround module) is imported, so
``import hf_lookaround; AutoModel.from_pretrained(checkpoint)`` works.
"""

import importlib
from typing import TYPE_CHECKING

from . import auto_registration

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "LookAroundConfig": "models.lookaround.configuration_lookaround",
    "PRESETS": "models.lookaround.configuration_lookaround",
    "LookAroundViTConfig": "models.lookaround.configuration_lookaround_vit",
    "LookAroundPreTrainedModel": "models.lookaround.modeling_lookaround",
    "LookAroundModel": "models.lookaround.modeling_lookaround",
    "LookAroundForPreTraining": "models.lookaround.modeling_lookaround",
    "LookAroundForMaskedLM": "models.lookaround.modeling_lookaround",
    "LookAroundForCausalLM": "models.lookaround.modeling_lookaround",
    "LookAroundForSequenceClassification": "models.lookaround.modeling_lookaround",
    "LookAroundViTPreTrainedModel": "models.lookaround.modeling_lookaround_vit",
    "LookAroundViTModel": "models.lookaround.modeling_lookaround_vit",
    "LookAroundViTForPreTraining": "models.lookaround.modeling_lookaround_vit",
    "LookAroundViTForImageClassification": "models.lookaround.modeling_lookaround_vit",
    "Plan": "plans",
    "PLAN_NAMES": "objectives",
    "make_plan": "objectives",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported eagerly
    from .models.lookaround.configuration_lookaround import PRESETS, LookAroundConfig
    from .models.lookaround.configuration_lookaround_vit import LookAroundViTConfig
    from .models.lookaround.modeling_lookaround import (
        LookAroundForCausalLM,
        LookAroundForMaskedLM,
        LookAroundForPreTraining,
        LookAroundForSequenceClassification,
        LookAroundModel,
        LookAroundPreTrainedModel,
    )
    from .models.lookaround.modeling_lookaround_vit import (
        LookAroundViTForImageClassification,
        LookAroundViTForPreTraining,
        LookAroundViTModel,
        LookAroundViTPreTrainedModel,
    )
    from .objectives import PLAN_NAMES, make_plan
    from .plans import Plan


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


auto_registration.install()
