"""Element sizes of the data types labkit knows.

Weights, activations and KV caches are stored in one of a few dtypes; everything that
counts bytes (capacity, the cost model, transfers) goes through `dtype_bytes`.
"""

from __future__ import annotations

from labkit.errors import unknown_choice

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise unknown_choice("dtype", dtype, DTYPE_BYTES) from None
