"""Physical sanity of the cost model, independent of any data.

Each assertion could fail: a sign error, a unit slip (ms for s, bits for bytes), a
constant past its bound or a wrong datasheet number would break one of them.
"""

import numpy as np
import pytest

from labkit.costmodel import CostModel
from labkit.specs import HARDWARE_PRESETS

PRESETS = sorted(HARDWARE_PRESETS)


@pytest.fixture(scope="module", params=PRESETS)
def cm(request):
    return CostModel(request.param)


def test_time_grows_with_work(cm):
    sizes = np.array([1, 16, 256, 4096, 65536], dtype=float)
    series = [
        cm.gemm(sizes, 4096, 4096),
        cm.attention_decode(sizes, 8192, 32, 8, 128),
        cm.attention_decode(8, sizes, 32, 8, 128),
        cm.attention_prefill(1, sizes, 0, 32, 8, 128),
        cm.attention_prefill(1, 512, sizes, 32, 8, 128),
        cm.mla_decode(64, sizes, 128),
        cm.mla_prefill(1, sizes, 0, 128),
        cm.mla_decode_module(sizes, 4096, 128),
        cm.mla_prefill_module(1, sizes, 0, 128),
        cm.sparse_attention(sizes, 1, 2048, 128),
        cm.indexer(1, 1, sizes),
        cm.moe(sizes, 7168, 2048, 8, 256, ep_size=8, dtype="fp8_block"),
        cm.collective("all_reduce", sizes * 1e3, 8),
        cm.p2p(sizes * 1e3), cm.host_transfer(sizes * 1e3),
    ]
    for i, s in enumerate(series):
        assert np.all(np.diff(s) > 0), f"series {i} does not grow: {s}"
        assert np.all(s > 0)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp8_block"])
def test_large_gemm_approaches_but_never_exceeds_peak(cm, dtype):
    peak = cm.hardware.flops("bf16" if dtype == "bf16" else "fp8")
    m = n = k = np.array([1024, 4096, 16384, 65536], dtype=float)
    achieved = 2 * m * n * k / cm.gemm(m, n, k, dtype)
    assert np.all(achieved < peak)
    assert np.all(np.diff(achieved) > 0)  # bigger GEMMs get closer to peak
    assert achieved[-1] > 0.5 * peak  # large GEMMs run at a healthy fraction of it


def test_fp8_gemm_faster_than_bf16_at_large_shapes(cm):
    if cm.hardware.flops_fp8 <= cm.hardware.flops_bf16:
        pytest.skip(f"{cm.hardware.name} has no FP8 tensor cores (fp8 runs at the bf16 rate)")
    for m in (4096, 16384):
        bf16 = cm.gemm(m, 8192, 8192, "bf16")
        assert cm.gemm(m, 8192, 8192, "fp8") < bf16
        assert cm.gemm(m, 8192, 8192, "fp8_block") < bf16


def test_decode_gemm_is_weight_streaming(cm):
    """A batch-1 GEMM reads the weight once: time ~ bytes / HBM bandwidth, not FLOPs."""
    t = cm.gemm(1, 16384, 16384)
    floor = 16384 * 16384 * 2 / cm.hardware.hbm_bandwidth
    assert floor < t < 1.5 * floor


def test_h200_decode_attention_faster_than_h100_by_the_bandwidth_ratio():
    h100, h200 = CostModel("h100"), CostModel("h200")
    ratio_hbm = h200.hardware.hbm_bandwidth / h100.hardware.hbm_bandwidth  # 1.43
    for args in [(64, 32768, 32, 8, 128), (256, 8192, 64, 8, 128)]:
        ratio = h100.attention_decode(*args) / h200.attention_decode(*args)
        assert 0.9 * ratio_hbm < ratio <= ratio_hbm
    ratio = h100.mla_decode(128, 32768, 16) / h200.mla_decode(128, 32768, 16)
    assert 0.85 * ratio_hbm < ratio <= ratio_hbm


def test_b200_faster_than_h200():
    h200, b200 = CostModel("h200"), CostModel("b200")
    pairs = [
        (h200.gemm(8192, 8192, 8192), b200.gemm(8192, 8192, 8192)),
        (h200.gemm(8, 8192, 8192, "fp8"), b200.gemm(8, 8192, 8192, "fp8")),
        (h200.attention_decode(64, 32768, 32, 8, 128),
         b200.attention_decode(64, 32768, 32, 8, 128)),
        (h200.attention_prefill(1, 8192, 0, 32, 8, 128),
         b200.attention_prefill(1, 8192, 0, 32, 8, 128)),
        (h200.mla_decode_module(64, 32768, 16), b200.mla_decode_module(64, 32768, 16)),
        (h200.moe(4096, 7168, 2048, 8, 256, ep_size=8, dtype="fp8_block"),
         b200.moe(4096, 7168, 2048, 8, 256, ep_size=8, dtype="fp8_block")),
        (h200.collective("all_reduce", 64e6, 8), b200.collective("all_reduce", 64e6, 8)),
    ]
    for i, (slow, fast) in enumerate(pairs):
        assert fast < slow, f"pair {i}: b200 {fast} >= h200 {slow}"


def test_all_reduce_is_about_twice_reduce_scatter_at_large_messages(cm):
    for gpus in (4, 8, 16):
        ar = cm.collective("all_reduce", 1e9, gpus)
        rs = cm.collective("reduce_scatter", 1e9, gpus)
        assert 1.6 < ar / rs < 2.2


def test_inter_node_slower_than_intra_node(cm):
    if cm.hardware.nvlink_bandwidth <= cm.hardware.pcie_bandwidth:
        pytest.skip(f"{cm.hardware.name} has no NVLink: its GPUs talk over PCIe inside a "
                    "node too, barely faster than the NIC")
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for nbytes in (1e4, 1e6, 1e8):
            assert cm.collective(op, nbytes, 16) > cm.collective(op, nbytes, 8)
    assert cm.p2p(1e8, "ib") > cm.p2p(1e8, "nvlink")
    assert cm.collective("all_reduce", 1e6, 1) == 0.0  # one GPU: nothing to reduce


def test_transfers_follow_link_bandwidth(cm):
    big = 10e9
    assert cm.p2p(big, "pcie") == pytest.approx(cm.host_transfer(big, "d2h"))
    # large transfers reach a fixed fraction of the link, below the datasheet rate
    for link, bw in [("nvlink", cm.hardware.nvlink_bandwidth),
                     ("ib", cm.hardware.internode_bandwidth), ("pcie", cm.hardware.pcie_bandwidth)]:
        rate = big / cm.p2p(big, link)
        assert 0.5 * bw < rate < bw


def test_fp8_kv_cache_helps_long_decode(cm):
    assert cm.attention_decode(64, 65536, 32, 8, 128, "fp8") < \
        cm.attention_decode(64, 65536, 32, 8, 128, "bf16")
    assert cm.mla_decode(64, 65536, 128, kv_dtype="fp8") < cm.mla_decode(64, 65536, 128)


def test_sparse_attention_is_cheaper_than_dense_at_long_context(cm):
    """DSA reads topk entries per query instead of the whole context: at 128K tokens of
    context the gather plus the indexer beat dense MLA decode, at 2K they do not."""
    def dsa(ctx):
        return cm.sparse_attention(64, 1, 2048, 128) + cm.indexer(64, 1, ctx)
    assert dsa(131072) < cm.mla_decode(64, 131072, 128)
    assert dsa(2048) > cm.mla_decode(64, 2048, 128)


def test_indexer_is_quadratic_in_a_full_prefill(cm):
    t1, t2 = cm.indexer(1, 32768, 0), cm.indexer(1, 65536, 0)
    assert 3.5 < t2 / t1 < 4.1


def test_moe_expert_parallel_cuts_time_but_not_linearly(cm):
    t = [cm.moe(8192, 7168, 2048, 8, 256, ep_size=ep, dtype="fp8_block") for ep in (1, 8, 64)]
    assert t[0] > t[1] > t[2]
    assert t[1] > t[0] / 8  # the fused kernel still walks every routed row
    # skewed routing: the busiest rank is slower than a balanced one under EP
    assert cm.moe(8192, 7168, 2048, 8, 256, ep_size=8, dtype="fp8_block",
                  distribution="power_law") > t[1]


def test_hardware_is_exposed(cm):
    assert cm.hardware.name in PRESETS
