"""Specs: what is served (ModelSpec), on what (HardwareSpec), how it is spread over
GPUs (Layout) and with which knobs (EngineConfig)."""

from labkit.specs.config import EngineConfig, knob_fields, knob_names
from labkit.specs.dtypes import dtype_bytes
from labkit.specs.hardware import HARDWARE_PRESETS, HardwareSpec, get_hardware
from labkit.specs.layout import Layout
from labkit.specs.model_presets import MODEL_PRESETS, get_model
from labkit.specs.models import ModelSpec

__all__ = [
    "EngineConfig", "HardwareSpec", "Layout", "ModelSpec", "HARDWARE_PRESETS", "MODEL_PRESETS",
    "dtype_bytes", "get_hardware", "get_model", "knob_fields", "knob_names",
]
