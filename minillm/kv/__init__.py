"""KV storage: where keys and values of past tokens live between decode steps."""
from .contiguous import KVCache, kv_cache_bytes

__all__ = ["KVCache", "kv_cache_bytes"]
