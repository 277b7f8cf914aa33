"""An op-level cost model of LLM serving kernels, calibrated on measured H100 latencies.

The simulated data plane never runs a kernel; it asks this package how long one would
take. Each op (GEMM, attention, MLA, DSA, MoE, collectives, transfers) is priced from
the work it does (FLOPs, bytes, parallel work units) and a GPU's datasheet (peak FLOP/s
per dtype, HBM / NVLink / InfiniBand / PCIe bandwidth, SM count), through a handful of
efficiencies and latencies fitted once on H100 SXM measurements of vLLM's kernels.

Reading order: `device` (what a GPU is), `curves` (how limits combine), `params` (the
fitted constants), then one file per op family (`gemm`, `attention`, `mla`, `sparse`,
`moe` with `routing`, `comm`), and `model` (the `CostModel` facade). `fit` re-derives the constants
from the data (`python -m labkit.costmodel.fit`); `bench` reports the errors.
"""

from labkit.costmodel.device import SM_COUNTS, Device, make_device
from labkit.costmodel.mla import MlaDims
from labkit.costmodel.model import CostModel
from labkit.costmodel.params import CALIBRATED, CostModelParams

__all__ = ["CALIBRATED", "SM_COUNTS", "CostModel", "CostModelParams",
           "Device", "MlaDims", "make_device"]
