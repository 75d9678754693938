"""KV storage: where keys and values of past tokens live between decode steps."""
from .contiguous import CachedAttention, KVCache, kv_cache_bytes
from .paged import BlockPool, OutOfBlocks
from .quantized import KV_DTYPES, QuantizedKV

__all__ = ["BlockPool", "CachedAttention", "KVCache", "KV_DTYPES", "OutOfBlocks", "QuantizedKV", "kv_cache_bytes"]
