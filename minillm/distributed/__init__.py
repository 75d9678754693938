"""Beyond one device, on torch.distributed (gloo on CPUs, NCCL on GPUs).

    tensor_parallel.py   one model split across ranks, Megatron-style: shard_model, check_tensor_parallel
    leader.py            rank 0 tokenizes, samples and answers; the other ranks only run forward passes
    launch.py            start N ranks from one command (loopback rendezvous, timeouts) or under torchrun
    kv_transfer.py       a sequence's K/V blocks from one block pool to another, point-to-point
    disaggregated.py     prefill on one worker, decode on another, the KV cache shipped between them
"""
from .tensor_parallel import check_tensor_parallel, shard_model

__all__ = ["check_tensor_parallel", "shard_model"]
