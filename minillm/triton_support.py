"""Whether Triton is here, and one clear error where it is not.

Triton publishes wheels for Linux only, so `pip install minillm` leaves it out on macOS and Windows.
Everything but the Triton stages works there: naive, kv, the serving engine (its CPU attention is
PyTorch's) and quantization. The Triton stages (flash, paged) and the GPU matmul kernel need Linux,
where they run on a CPU through Triton's interpreter (TRITON_INTERPRET=1) or compiled on a GPU.
"""
from __future__ import annotations

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None


class TritonUnavailable(ImportError):
    """Raised on first use of a Triton kernel where the triton package is not installed."""


def require_triton(what: str = "this kernel") -> None:
    if not HAS_TRITON:
        raise TritonUnavailable(
            f"{what} runs on Triton, which ships for Linux only (pip install triton). On macOS and Windows use "
            "the stages naive, kv or continuous; the course notebooks show committed results for the Triton ones")


def kernel_source(module: str, name: str) -> str:
    """The source of a function in one of minillm's modules, read from the file (no import), so a notebook
    can show a Triton kernel where Triton is not installed. module: e.g. "attention/triton_flash.py"."""
    import ast
    from pathlib import Path

    path = Path(__file__).resolve().parent / module
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            return "\n".join(text.splitlines()[start:node.end_lineno]) + "\n"
    raise ValueError(f"no function {name!r} in minillm/{module}")
