"""Which constants a model computes with, and whether labkit can compute it at all.

The constants themselves (`FamilyConfig`: RoPE, norm epsilon, router, activation) are
data in `labkit.specs.family`: a model read from a Hugging Face config carries its
own, a preset its family's. The torch code asks `family_config(spec)` for them, and
the compute plane asks `check_computable(spec)` once, before it builds anything.
"""

from __future__ import annotations

from labkit.errors import ConfigError, unknown_choice
from labkit.specs.family import FAMILIES, FamilyConfig, RopeSpec
from labkit.specs.models import ModelSpec

__all__ = ["FAMILIES", "FamilyConfig", "RopeSpec", "check_computable", "family_config"]


def family_config(spec: ModelSpec) -> FamilyConfig:
    """The model's own constants, else its family's; a clear error for an unknown family."""
    if spec.constants is not None:
        return spec.constants
    try:
        return FAMILIES[spec.family]
    except KeyError:
        raise unknown_choice("model family (compute plane)", spec.family, FAMILIES) from None


def check_computable(spec: ModelSpec) -> None:
    """Refuse, naming the reason, a model whose function labkit's torch models do not
    compute: a family without a model here, or config keys they do not implement."""
    if spec.family not in FAMILIES:
        raise ConfigError(f"{spec.name}: the compute plane has no model of family "
                          f"{spec.family!r} (it runs {', '.join(FAMILIES)}); the simulation "
                          "(backend='sim') still serves it")
    cfg = family_config(spec)
    if cfg.unsupported:
        raise ConfigError(f"{spec.name}: the compute plane cannot compute this model: "
                          + "; ".join(cfg.unsupported))
