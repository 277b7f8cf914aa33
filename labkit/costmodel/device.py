"""The GPU as the cost model sees it: datasheet peaks plus a streaming-multiprocessor count.

Every op in this package turns *work* (FLOPs, bytes, parallel work units) into seconds
with the same few numbers, all from public datasheets:

- peak dense FLOP/s per dtype and HBM bandwidth, from `labkit.specs.HardwareSpec`;
- NVLink, inter-node (InfiniBand) and PCIe bandwidth per direction, from the same spec;
- the number of SMs, kept here because `HardwareSpec` does not carry it. Kernels hand
  out work in units (tiles, sequences x heads) to SMs, so small batches leave SMs idle
  and a per-unit cost is paid once per wave of SMs. A GPU with more SMs of the same
  generation finishes such wave-bound work sooner.

What kernels *achieve* (fractions of these peaks, fixed latencies) is fitted on H100
measurements and lives in `params.py`; nothing here is fitted. That split is what lets
the model move to an H200 or B200: the fitted fractions stay, the datasheet numbers
change.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import ConfigError
from labkit.specs.hardware import HARDWARE_ALIASES, HardwareSpec, get_hardware

# SM counts from NVIDIA's datasheets / whitepapers (H100 SXM5: 132 of the die's 144;
# H200 SXM: the same GH100 configuration; B200: 148 across its two dies; A100: 108 of
# GA100's 128; L40S: 142 of AD102's 144).
SM_COUNTS: dict[str, int] = {"h100": 132, "h200": 132, "b200": 148, "a100-80gb": 108,
                             "l40s": 142}


@dataclass(frozen=True, slots=True)
class Device:
    """A `HardwareSpec` plus its SM count: everything an op needs to price work."""

    spec: HardwareSpec
    sms: int

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of a GEMM whose operands are `dtype` ("fp8_block" is fp8)."""
        return self.spec.flops("fp8" if dtype == "fp8_block" else dtype)

    @property
    def hbm_bandwidth(self) -> float:
        return self.spec.hbm_bandwidth


def make_device(hardware: str | HardwareSpec, sm_count: int | None = None) -> Device:
    """Resolve a preset name or a spec; the SM count comes from `SM_COUNTS` unless given."""
    spec = get_hardware(hardware)
    if sm_count is None:
        name = HARDWARE_ALIASES.get(spec.name.lower(), spec.name.lower())
        if name not in SM_COUNTS:
            raise ConfigError(
                f"no SM count known for hardware {spec.name!r}; pass sm_count=... "
                f"(known: {', '.join(SM_COUNTS)})")
        sm_count = SM_COUNTS[name]
    if sm_count <= 0:
        raise ConfigError(f"sm_count must be positive, got {sm_count}")
    return Device(spec, int(sm_count))
