"""Backends: the plain model (`model.py`) made fast for a device, from outside, chosen once.

    fast = apply_backend(model, "native")      a copy of the model's modules (its weights shared, not
                                               copied) with faster layers swapped in; `model` stays plain
    fast.backend                               "native"
    fast.backend_report                        which kernel each kind of layer got, and the times that chose it
    describe(fast)                             the same, as lines to print

    "torch"    the reference: the model as it is, PyTorch's operators (on a CPU or a GPU)
    "native"   on a CPU: the C loops of `matvec.c` for a decode's few rows, a block's halves in one C call
               (`c_block.c`), oneDNN's packed weights for big steps (`pack_weights=True`), and the engine's
               paged attention read in place by the C kernel (`attention/cpu_kernel.py`); each where this
               machine measured it faster (`races.py`: the races run here, not inside a request, and are
               remembered on disk)
    "auto"     the fastest measured: native on a CPU (where a C compiler or oneDNN gives it anything to
               choose), torch elsewhere (on a GPU the engine's Triton kernels and CUDA graphs are its own
               options: `attention=`, `enforce_eager=`)

The stages of the course (`generate`, the runners) run the model they are given: a plain model runs on
torch, so notebooks 01-13 measure their idea on PyTorch's operators; notebook 14 applies "native". `LLM`,
`python -m minillm serve` and `bench` apply "auto" unless told otherwise.
"""
from __future__ import annotations

from .prepared import backend_of, copy_modules, plain_model

__all__ = ["BACKENDS", "apply_backend", "backend_of", "copy_modules", "describe", "plain_model", "report", "resolve"]
BACKENDS = ("auto", "torch", "native")


def resolve(backend: str, model) -> str:
    """"auto" -> "native" on a CPU, else "torch"; "native" off the CPU: ValueError; anything else: ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    on_cpu = model.device.type == "cpu"
    if backend == "auto":
        return "native" if on_cpu else "torch"
    if backend == "native" and not on_cpu:
        raise ValueError(f"the native backend runs on a CPU; this model is on {model.device} (use 'torch' or 'auto')")
    return backend


def apply_backend(model, backend: str = "auto", *, pack_weights: bool | None = None, remember: bool = True):
    """The model prepared for `backend` ("auto", "torch", "native"): the plain model itself for torch, else a
    copy of its modules with faster layers (see the module's docstring). pack_weights: for native, a second
    copy of the float weights in oneDNN's layout for big steps, where it measures faster (True), or not
    (False); None: a model already prepared for this backend stays as it is, a plain one is not packed. A
    prepared model asked for another backend or packing is prepared again from its plain one.
    remember=False: measure the races again instead of reading them from disk."""
    base = plain_model(model)
    backend = resolve(backend, base)
    if backend == "torch":
        return base
    if backend_of(model) == backend and pack_weights in (None, model.backend_report.get("pack_weights")):
        return model
    from .native import prepare

    return prepare(base, pack_weights=bool(pack_weights), remember=remember)


def report(model) -> dict:
    """{"backend", "kernels": {kind: {"chosen": what, "measured": the race's times or None}}} (JSON-ready)."""
    return model.__dict__.get("backend_report") or {"backend": backend_of(model), "kernels": {}}


def describe(model) -> list[str]:
    """Which kernel each kind of layer got, and why: one line each."""
    said = report(model)
    if not said["kernels"]:
        return [f"backend {said['backend']}: PyTorch's operators"]
    return [f"backend {said['backend']}:"] + [f"  {kind}: {k['chosen']}" for kind, k in said["kernels"].items()]
