"""Where a model and its kernels run: one rule for the whole package.

    device = pick_device()            # cuda when this torch sees a GPU, else cpu
    use_triton_interpreter()          # before triton is first imported: on a CPU, Triton interprets

Everything that runs a model or a kernel (`load_model`, `LLM`, the kernel checks, the CLI, the notebooks)
asks `pick_device` for its default, so a Linux machine with an NVIDIA GPU runs the compiled Triton kernels
on the GPU and a laptop runs them through the interpreter on the CPU. This module imports torch only:
it must not import triton, because the interpreter has to be chosen before that import.
"""
from __future__ import annotations

import os

import torch


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The device asked for, or by default the GPU when there is one and the CPU otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but this torch build sees no GPU: use device='cpu'")
    return device


def use_triton_interpreter() -> bool:
    """Switch Triton's interpreter on (TRITON_INTERPRET=1) where there is no GPU, and leave Triton compiled
    where there is one. It only counts before triton is first imported. Returns whether it is on."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
