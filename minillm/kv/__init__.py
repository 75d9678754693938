"""KV storage: where keys and values of past tokens live between decode steps."""
from .contiguous import KVCache, kv_cache_bytes
from .paged import BlockPool, OutOfBlocks

__all__ = ["BlockPool", "KVCache", "OutOfBlocks", "kv_cache_bytes"]
