"""The native model families, one ModelSpec each (fastppl.models.spec), defined in the family's own file. Loading,
accel/, engine/ and bench/ ask these functions what a family is and offers; none of them asks a model's class.

Adding a family: one file in this package (its architecture, config and name maps, presets and SPEC), its line in
SPECS below, and its tests against transformers (docs/adding-a-family.md)."""
from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from . import gpt2, llama, qwen3
from .spec import HFSizeKeys, ModelShape, ModelSpec, NotNative

__all__ = ["SPECS", "HFSizeKeys", "ModelShape", "ModelSpec", "NotNative", "native_model_types", "spec_for_model_type",
           "spec_of", "spec_of_config", "spec_of_preset", "presets"]

SPECS: tuple[ModelSpec, ...] = (gpt2.SPEC, llama.SPEC, llama.QWEN2_SPEC, llama.MISTRAL_SPEC, qwen3.SPEC)

_BY_MODEL_TYPE = {model_type: spec for spec in SPECS for model_type in spec.model_types}
# a model's `family` class attribute -> the spec that built it (Qwen2 and Mistral checkpoints build a Llama)
_BY_FAMILY = {spec.model_class.family: spec for spec in SPECS if spec.model_class.family == spec.name}
assert len(_BY_MODEL_TYPE) == sum(len(spec.model_types) for spec in SPECS), "a model_type claimed twice"


def native_model_types() -> tuple[str, ...]:
    """The config.json model_types a native family takes."""
    return tuple(_BY_MODEL_TYPE)


def spec_for_model_type(model_type: Any) -> Optional[ModelSpec]:
    """The family that takes checkpoints of this config.json model_type, or None (transformers runs them)."""
    return _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def spec_of(model: nn.Module) -> Optional[ModelSpec]:
    """The spec of a built native model; None for any other (a transformers model behind HFCausalLM)."""
    return _BY_FAMILY.get(getattr(type(model), "family", None))


def spec_of_config(config: Any) -> Optional[ModelSpec]:
    """The family of a native config (the first spec of its exact class: Llama's for a Qwen2 checkpoint's)."""
    return next((spec for spec in SPECS if type(config) is spec.config_class), None)


def presets() -> dict[str, Any]:
    """random:<name> -> native config, over every family."""
    return {name: config for spec in SPECS for name, config in spec.presets.items()}


def spec_of_preset(preset: str) -> Optional[ModelSpec]:
    return next((spec for spec in SPECS if preset in spec.presets), None)
