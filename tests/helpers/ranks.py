"""Functions the distributed tests run in every rank (importable by the spawned processes)."""
import os

import torch
import torch.distributed as dist


def sum_of_ranks(rank, world):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return float(x)


def rank_one_raises(rank, world):
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    dist.all_reduce(torch.zeros(1))       # rank 0 waits here for a partner that is gone
    return "unreachable"


def rank_one_dies(rank, world):
    if rank == 1:
        os._exit(3)                        # no exception, no message: the process is simply gone
    dist.all_reduce(torch.zeros(1))
    return "unreachable"
