"""Reading and writing a block pool's K/V by hand, as tests check them (the engine writes through its
runner, and reads through attention)."""
import torch


def write(pool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v (n, n_kv, hd) at `slots` (n,) of `layer`."""
    pool.k[layer].view(-1, *pool.k.shape[3:])[slots] = k
    pool.v[layer].view(-1, *pool.v.shape[3:])[slots] = v


def gather(pool, layer: int, seq) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of `seq` as contiguous (length, n_kv, hd) tensors (dequantized for a quantized pool)."""
    slots = pool.slots(seq, 0, pool.lengths[seq])
    k, v = (c[layer].view(-1, *c.shape[3:])[slots] for c in (pool.k, pool.v))
    return (k.dequantize(), v.dequantize()) if pool.kv_dtype else (k, v)
