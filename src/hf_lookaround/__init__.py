"""hf_lookaround: autoregressive, masked and group-rank objectives on one two-stream transformer.

Importing the package registers the LookAround classes with transformers' Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
)

from .configuration_lookaround import PRESETS, LookAroundConfig
from .configuration_lookaround_vit import LookAroundViTConfig
from .modeling_lookaround import (
    LookAroundForCausalLM,
    LookAroundForMaskedLM,
    LookAroundForPreTraining,
    LookAroundForSequenceClassification,
    LookAroundModel,
    LookAroundPreTrainedModel,
)
from .modeling_lookaround_vit import (
    LookAroundViTForImageClassification,
    LookAroundViTForPreTraining,
    LookAroundViTModel,
    LookAroundViTPreTrainedModel,
)
from .plans import PLAN_NAMES, Plan, make_plan

__version__ = "0.1.0"

# (config, {Auto class name: (Auto class, model class)}) for each model family
FAMILIES = [
    (LookAroundConfig, {
        "AutoModel": (AutoModel, LookAroundModel),
        "AutoModelForPreTraining": (AutoModelForPreTraining, LookAroundForPreTraining),
        "AutoModelForMaskedLM": (AutoModelForMaskedLM, LookAroundForMaskedLM),
        "AutoModelForCausalLM": (AutoModelForCausalLM, LookAroundForCausalLM),
        "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, LookAroundForSequenceClassification),
    }),
    (LookAroundViTConfig, {
        "AutoModel": (AutoModel, LookAroundViTModel),
        "AutoModelForPreTraining": (AutoModelForPreTraining, LookAroundViTForPreTraining),
        "AutoModelForImageClassification": (AutoModelForImageClassification, LookAroundViTForImageClassification),
    }),
]

for _config, _heads in FAMILIES:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    # save_pretrained copies the modeling code next to the weights and writes `auto_map`, so a process
    # that never imported this package loads any head with trust_remote_code=True.
    _config.register_for_auto_class()
    for _name, (_auto, _model) in _heads.items():
        _auto.register(_config, _model, exist_ok=True)
        _model.register_for_auto_class(_name)

__all__ = [
    "LookAroundConfig",
    "PRESETS",
    "LookAroundPreTrainedModel",
    "LookAroundModel",
    "LookAroundForPreTraining",
    "LookAroundForMaskedLM",
    "LookAroundForCausalLM",
    "LookAroundForSequenceClassification",
    "LookAroundViTConfig",
    "LookAroundViTPreTrainedModel",
    "LookAroundViTModel",
    "LookAroundViTForPreTraining",
    "LookAroundViTForImageClassification",
    "Plan",
    "PLAN_NAMES",
    "make_plan",
]
