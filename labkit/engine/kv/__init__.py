"""Paged KV: the block pool, block keys and the per-rank KV manager."""

from labkit.engine.kv.block_keys import TokenBlockKeys, TraceBlockKeys, check_block_sizes
from labkit.engine.kv.block_pool import BlockPool
from labkit.engine.kv.free_queue import FreeBlockQueue
from labkit.engine.kv.block_table import PrefixHint, PrefixMatch
from labkit.engine.kv.kv_manager import KVManager

__all__ = ["BlockPool", "FreeBlockQueue", "KVManager", "PrefixHint", "PrefixMatch",
           "TokenBlockKeys", "TraceBlockKeys", "check_block_sizes"]
