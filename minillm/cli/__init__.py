"""`python -m minillm generate | chat | serve | bench | export | course`: one module per command.

    parser.py            the arguments of every command
    common.py            loading, sampling settings, the checks every command makes, a one-line failure
    generate.py          generate (tensor_parallel.py: with --tensor-parallel N)
    chat.py, serve.py, bench.py, export.py, course.py

Bad input (unknown stage, missing model, invalid sampling values, a prompt longer
than the context) ends the command with one line on stderr that says what to
fix, and exit status 2; never a traceback.
"""
from __future__ import annotations

import logging
import sys

from .common import fail
from .parser import build_parser

__all__ = ["build_parser", "main"]


def _log_to_stderr() -> None:
    """The engine reports what it sets up (KV cache size, tokens that fit) at INFO level: on stderr,
    unless logging is configured already."""
    log = logging.getLogger("minillm")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("minillm: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv=None) -> None:
    from ..device import use_triton_interpreter
    from ..triton_support import TritonUnavailable
    from ..weights import ModelNotFoundError

    use_triton_interpreter()   # on a CPU the Triton kernels are interpreted: on before anything imports triton

    from .bench import cmd_bench
    from .chat import cmd_chat
    from .course import cmd_course
    from .export import cmd_export
    from .generate import cmd_generate
    from .serve import cmd_serve

    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "course": cmd_course,
         "serve": cmd_serve, "export": cmd_export}[args.command](args)
    except (ValueError, ModelNotFoundError, TritonUnavailable) as e:
        fail(str(e))
    except BrokenPipeError:
        sys.stderr.close()
