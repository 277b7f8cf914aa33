"""GPUs as datasheets describe them.

The simulated data plane never sees a GPU; it sees these numbers. Peaks are the
vendors' dense (non-sparse) figures; what kernels actually achieve is the cost model's
business, not the spec's. Bandwidths are stored **per direction** (NVLink datasheet
figures are bidirectional totals, so they are halved here). Units: FLOP/s, bytes,
bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import unknown_choice

GB = 1e9
TB = 1e12


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    flops_bf16: float  # dense peak FLOP/s
    flops_fp8: float
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per direction, per GPU
    internode_bandwidth: float  # bytes/s per direction, per GPU (one NIC each)
    pcie_bandwidth: float  # bytes/s per direction, host link
    gpus_per_node: int = 8
    source: str = ""
    # The node around the GPUs, for KV offload tiers (DGX H100/H200/B200 class nodes).
    host_memory_bytes: float = 2 * TB  # CPU DRAM per node
    host_link_latency_s: float = 10e-6  # one host<->GPU copy: launch + first byte
    disk_bytes: float = 30.72 * TB  # 8 x 3.84 TB NVMe U.2 per node
    disk_bandwidth: float = 50 * GB  # node aggregate read, 8 drives x ~6.5 GB/s
    disk_latency_s: float = 100e-6  # an NVMe read of a block-sized extent

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for a GEMM in `dtype` (fp8 weights run fp8 GEMMs)."""
        if dtype == "fp8":
            return self.flops_fp8
        if dtype in ("bf16", "fp16"):
            return self.flops_bf16
        raise unknown_choice("compute dtype", dtype, ["bf16", "fp16", "fp8"])


_IB_400G = 400e9 / 8  # one 400 Gb/s InfiniBand NIC per GPU
_PCIE5_X16 = 64 * GB
_PCIE4_X16 = 32 * GB

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    h.name: h
    for h in [
        HardwareSpec(
            "h100", flops_bf16=989 * TB, flops_fp8=1979 * TB, hbm_bytes=80 * GB,
            hbm_bandwidth=3.35 * TB, nvlink_bandwidth=900 * GB / 2,
            internode_bandwidth=_IB_400G, pcie_bandwidth=_PCIE5_X16,
            source="NVIDIA H100 SXM datasheet",
        ),
        HardwareSpec(
            "h200", flops_bf16=989 * TB, flops_fp8=1979 * TB, hbm_bytes=141 * GB,
            hbm_bandwidth=4.8 * TB, nvlink_bandwidth=900 * GB / 2,
            internode_bandwidth=_IB_400G, pcie_bandwidth=_PCIE5_X16,
            source="NVIDIA H200 SXM datasheet",
        ),
        HardwareSpec(
            "b200", flops_bf16=2250 * TB, flops_fp8=4500 * TB, hbm_bytes=180 * GB,
            hbm_bandwidth=8 * TB, nvlink_bandwidth=1800 * GB / 2,
            internode_bandwidth=_IB_400G, pcie_bandwidth=_PCIE5_X16,
            source="NVIDIA HGX B200 datasheet",
        ),
        # ---- GPUs of the measured end-to-end runs (labkit validate) -----------------
        # A100 has no FP8 tensor cores: fp8 weights run as W8A16 GEMMs at the bf16 rate.
        HardwareSpec(
            "a100-80gb", flops_bf16=312 * TB, flops_fp8=312 * TB, hbm_bytes=80 * GB,
            hbm_bandwidth=2.039 * TB, nvlink_bandwidth=600 * GB / 2,
            internode_bandwidth=200e9 / 8, pcie_bandwidth=_PCIE4_X16,
            source="NVIDIA A100 80GB SXM datasheet",
        ),
        # L40S: GDDR6, no NVLink — TP collectives cross PCIe Gen4 (host bridge); PCIe
        # servers carry about one 200 Gb/s NIC per GPU.
        HardwareSpec(
            "l40s", flops_bf16=362.05 * TB, flops_fp8=733 * TB, hbm_bytes=48 * GB,
            hbm_bandwidth=864 * GB, nvlink_bandwidth=_PCIE4_X16,
            internode_bandwidth=200e9 / 8, pcie_bandwidth=_PCIE4_X16,
            source="NVIDIA L40S datasheet (PCIe Gen4 x16, no NVLink)",
        ),
    ]
}

HARDWARE_ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "b200-hgx": "b200",
                    "a100": "a100-80gb", "a100-80gb-sxm": "a100-80gb"}


def get_hardware(hardware: str | HardwareSpec) -> HardwareSpec:
    if isinstance(hardware, HardwareSpec):
        return hardware
    name = HARDWARE_ALIASES.get(hardware.lower(), hardware.lower())
    if name not in HARDWARE_PRESETS:
        raise unknown_choice("hardware preset", hardware, HARDWARE_PRESETS)
    return HARDWARE_PRESETS[name]
