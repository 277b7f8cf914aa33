"""Moving bytes between GPUs and hosts: an alpha-beta model per collective.

A collective over n GPUs costs a latency (alpha) plus its traffic over the slowest
link (beta). NCCL's ring algorithms move, per GPU, a fixed multiple of the message
(`message_bytes` follows nccl-tests: the all-reduce buffer, the all-gather *output*,
the reduce-scatter *input*, the all-to-all send buffer):

    all_reduce      2(n-1)/n   (a reduce-scatter then an all-gather)
    all_gather       (n-1)/n
    reduce_scatter   (n-1)/n
    all_to_all       (n-1)/n   (each GPU keeps 1/n of its own buffer)

so at equal message size an all-reduce costs about twice a reduce-scatter. NCCL has
two kinds of protocol and picks the faster per size, so the model takes the minimum of
two alpha-beta lines:
- low-latency (LL/LL128): `base_s + hop_s * steps`, with 2(n-1) steps for an
  all-reduce, n-1 for all-gather / reduce-scatter and one (all pairs at once) for an
  all-to-all, but flags share the wire, so only `ll_eff` of the link carries data;
- bulk (Simple): a larger fixed `bulk_base_s`, and each op's own fraction `bus_eff` of
  the per-direction link bandwidth.

Up to `gpus_per_node` GPUs the link is NVLink. Beyond, each GPU's traffic crosses its
own InfiniBand NIC (rail-aligned rings), so the bandwidth term uses the inter-node
bandwidth; an all-to-all sends only the share addressed to other nodes over IB while
the rest goes over NVLink at the same time. Each ring step between nodes adds
`IB_HOP_S`. Inter-node constants are not fitted (the data holds one node): bus
efficiencies carry over from NVLink, and `IB_HOP_S` = 5 us is an assumption, the order
of one RDMA transfer through a switch plus NCCL's network proxy.

Point-to-point sends (KV transfer, PP boundaries) and host transfers (KV offload) are
latency + bytes / (bandwidth * efficiency); PCIe Gen5 x16 achieves ~50-55 of its
64 GB/s per direction (DESIGN.md), hence `PCIE_EFF`.
"""

from __future__ import annotations

import numpy as np

from labkit.costmodel.curves import smooth_max
from labkit.costmodel.device import Device
from labkit.costmodel.params import CommParams
from labkit.errors import unknown_choice

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
LINKS = ("nvlink", "ib", "pcie")
DIRECTIONS = ("h2d", "d2h")

IB_HOP_S = 5.0e-6  # one inter-node ring step (assumed, see above)
PCIE_EFF = 0.82  # ~52.5 of 64 GB/s achieved (DESIGN.md §5)
HOST_COPY_LATENCY_S = 10.0e-6  # cudaMemcpyAsync of pinned memory: call + DMA setup


def check_collective(op: str) -> None:
    if op not in COLLECTIVES:
        raise unknown_choice("collective", op, COLLECTIVES)


def _factor_and_steps(op: str, n: np.ndarray):
    if op == "all_reduce":
        return 2.0 * (n - 1.0) / n, 2.0 * (n - 1.0)
    if op == "all_to_all":
        return (n - 1.0) / n, np.ones_like(n)
    return (n - 1.0) / n, n - 1.0


def collective_seconds(dev: Device, p: CommParams, op: str, message_bytes,
                       num_gpus) -> np.ndarray:
    n = np.maximum(num_gpus, 1.0)
    g = float(dev.spec.gpus_per_node)
    factor, steps = _factor_and_steps(op, n)
    # Seconds on the wire at the full link rate. Inside a node: NVLink. Across nodes
    # each GPU's share crosses its own NIC; an all-to-all sends only the part addressed
    # to other nodes over IB, the rest over NVLink at the same time.
    nvlink = message_bytes * factor / dev.spec.nvlink_bandwidth
    if op == "all_to_all":
        ib = smooth_max(message_bytes * (n - g) / n / dev.spec.internode_bandwidth,
                        message_bytes * (g - 1.0) / n / dev.spec.nvlink_bandwidth)
    else:
        ib = message_bytes * factor / dev.spec.internode_bandwidth
    across = n > g
    wire = np.where(across, ib, nvlink)
    # node-crossing ring steps (one per node boundary, both ways for an all-reduce)
    crossings = (np.ceil(n / g) - 1.0) * (2.0 if op == "all_reduce" else 1.0)
    network = IB_HOP_S * crossings
    # NCCL picks, per size, the faster of its protocols: low-latency (small messages:
    # cheap steps, part of each line carries flags) and bulk (a larger fixed setup, the
    # op's full bus efficiency)
    low_latency = p.base_s + p.hop_s * steps + network + wire / p.ll_eff
    bulk = p.bulk_base_s + network + wire / p.bus_eff[op]
    return np.where(n <= 1.0, 0.0, np.minimum(low_latency, bulk))


def p2p_seconds(dev: Device, p: CommParams, nbytes, link: str) -> np.ndarray:
    if link not in LINKS:
        raise unknown_choice("link", link, LINKS)
    if link == "pcie":
        return HOST_COPY_LATENCY_S + nbytes / (dev.spec.pcie_bandwidth * PCIE_EFF)
    # a send is one ring step: both protocols as in a collective, all-gather's bus
    # efficiency for the bulk one
    if link == "nvlink":
        wire, network = nbytes / dev.spec.nvlink_bandwidth, 0.0
    else:
        wire, network = nbytes / dev.spec.internode_bandwidth, IB_HOP_S
    low_latency = p.base_s + p.hop_s + network + wire / p.ll_eff
    bulk = p.bulk_base_s + network + wire / p.bus_eff["all_gather"]
    return np.minimum(low_latency, bulk)


def host_transfer_seconds(dev: Device, nbytes, direction: str) -> np.ndarray:
    if direction not in DIRECTIONS:
        raise unknown_choice("host transfer direction", direction, DIRECTIONS)
    # PCIe is full duplex and its datasheet figure is per direction: h2d and d2h alike.
    return HOST_COPY_LATENCY_S + nbytes / (dev.spec.pcie_bandwidth * PCIE_EFF)
