"""hf_lookaround: autoregressive, masked and group-rank objectives on one two-stream transformer.

Importing the package registers the LookAround classes with transformers' Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
)

from .configuration_lookaround import PRESETS, LookAroundConfig
from .modeling_lookaround import (
    LookAroundForCausalLM,
    LookAroundForMaskedLM,
    LookAroundForPreTraining,
    LookAroundForSequenceClassification,
    LookAroundModel,
    LookAroundPreTrainedModel,
)
from .plans import PLAN_NAMES, Plan, make_plan

__version__ = "0.1.0"

AUTO_CLASSES = {
    "AutoModel": (AutoModel, LookAroundModel),
    "AutoModelForPreTraining": (AutoModelForPreTraining, LookAroundForPreTraining),
    "AutoModelForMaskedLM": (AutoModelForMaskedLM, LookAroundForMaskedLM),
    "AutoModelForCausalLM": (AutoModelForCausalLM, LookAroundForCausalLM),
    "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, LookAroundForSequenceClassification),
}

AutoConfig.register(LookAroundConfig.model_type, LookAroundConfig, exist_ok=True)
for _auto, _model in AUTO_CLASSES.values():
    _auto.register(LookAroundConfig, _model, exist_ok=True)

# save_pretrained copies the modeling code next to the weights and writes `auto_map`, so a process that
# never imported this package loads any head with trust_remote_code=True.
LookAroundConfig.register_for_auto_class()
for _name, (_, _model) in AUTO_CLASSES.items():
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
    "Plan",
    "PLAN_NAMES",
    "make_plan",
]
