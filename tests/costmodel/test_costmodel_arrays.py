"""Arrays in give, element by element, exactly what scalar calls give (bit for bit), and
scalars in give a Python float: the engine prices thousands of steps as one array."""

import numpy as np
import pytest

from labkit.costmodel import CostModel

rng = np.random.default_rng(7)
N = 40


def ints(lo, hi):
    return rng.integers(lo, hi, N).astype(float)


CASES = {
    "gemm": (lambda cm, *a: cm.gemm(*a, dtype="fp8"), [ints(1, 20000), ints(32, 20000),
                                                        ints(32, 20000)]),
    "gemm_bf16": (lambda cm, *a: cm.gemm(*a), [ints(1, 20000), ints(32, 20000), ints(32, 20000)]),
    "attention_decode": (lambda cm, *a: cm.attention_decode(*a, kv_dtype="fp8"),
                         [ints(1, 512), ints(0, 200000), ints(8, 64), ints(1, 8), ints(64, 256)]),
    "attention_prefill": (lambda cm, *a: cm.attention_prefill(*a),
                          [ints(1, 16), ints(1, 16384), ints(0, 100000), ints(8, 64),
                           ints(1, 8), ints(64, 256)]),
    "mla_decode": (lambda cm, *a: cm.mla_decode(*a, query_len=4),
                   [ints(1, 512), ints(0, 200000), ints(1, 129)]),
    "mla_prefill": (lambda cm, *a: cm.mla_prefill(*a), [ints(1, 8), ints(1, 16384),
                                                        ints(0, 65536), ints(1, 129)]),
    "mla_decode_module": (lambda cm, *a: cm.mla_decode_module(*a, gemm_dtype="fp8_block"),
                          [ints(1, 512), ints(0, 200000), ints(1, 129)]),
    "mla_prefill_module": (lambda cm, *a: cm.mla_prefill_module(*a, kv_dtype="fp8"),
                           [ints(1, 8), ints(1, 4096), ints(0, 65536), ints(1, 129)]),
    "sparse_attention": (lambda cm, *a: cm.sparse_attention(*a),
                         [ints(1, 256), ints(1, 8), ints(256, 4096), ints(8, 129)]),
    "indexer": (lambda cm, *a: cm.indexer(*a), [ints(1, 64), ints(1, 4096), ints(0, 200000)]),
    "moe": (lambda cm, *a: cm.moe(*a, dtype="fp8_block", distribution="power_law"),
            [ints(1, 20000), ints(1024, 8192), ints(256, 4096), ints(1, 9), ints(8, 512),
             2.0 ** rng.integers(0, 4, N), 2.0 ** rng.integers(0, 3, N)]),
    "collective": (lambda cm, *a: cm.collective("all_to_all", *a),
                   [ints(1, 10 ** 9), 2.0 ** rng.integers(0, 6, N)]),
    "all_reduce": (lambda cm, *a: cm.collective("all_reduce", *a),
                   [ints(1, 10 ** 9), 2.0 ** rng.integers(0, 6, N)]),
    "p2p": (lambda cm, *a: cm.p2p(*a, link="ib"), [ints(1, 10 ** 10)]),
    "host_transfer": (lambda cm, *a: cm.host_transfer(*a), [ints(1, 10 ** 10)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("hardware", ["h100", "b200"])
def test_array_equals_scalar_calls_exactly(name, hardware):
    cm = CostModel(hardware)
    op, args = CASES[name]
    together = op(cm, *args)
    assert isinstance(together, np.ndarray) and together.shape == (N,)
    for i in range(N):
        alone = op(cm, *[a[i] for a in args])
        assert type(alone) is float
        assert alone == together[i], f"{name}[{i}]: {alone!r} != {together[i]!r}"
    # integer scalars (the engine's natural input) give the same float
    ints_alone = op(cm, *[int(a[0]) for a in args])
    assert ints_alone == together[0]


def test_broadcasting_mixes_scalars_and_arrays():
    cm = CostModel("h200")
    batch = np.array([[1.0], [64.0]])
    ctx = np.array([1024.0, 8192.0, 65536.0])
    grid = cm.attention_decode(batch, ctx, 32, 8, 128)
    assert grid.shape == (2, 3)
    assert grid[1, 2] == cm.attention_decode(64, 65536, 32, 8, 128)


def test_same_inputs_same_bits():
    a, b = CostModel("h200"), CostModel("h200")
    x = np.linspace(1, 8192, 100)
    assert np.array_equal(a.moe(x, 7168, 2048, 8, 256, 8), b.moe(x, 7168, 2048, 8, 256, 8))
