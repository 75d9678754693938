"""What a prepared model carries: its backend's name, the plain model it was made from, and the copy of the
plain model's modules that it is (every tensor shared)."""
from __future__ import annotations

import copy

import torch


def backend_of(model) -> str:
    """The backend a model was prepared with: "torch" for a plain model."""
    return model.__dict__.get("backend", "torch")


def plain_model(model):
    """The plain model a prepared one was made from (the model itself where it is plain)."""
    return model.__dict__.get("plain", model)


def copy_modules(model):
    """The model's modules copied, every tensor in them shared: swapping a layer of the copy leaves the model's
    own, and no weight is copied."""
    memo = {}
    for m in model.modules():
        for v in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]:
            if isinstance(v, (torch.Tensor, torch.ScriptObject)):
                memo[id(v)] = v
    return copy.deepcopy(model, memo)
