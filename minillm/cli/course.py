"""`python -m minillm course`: JupyterLab on the course notebooks."""
from __future__ import annotations

import sys

from .common import fail


def cmd_course(args) -> None:
    """JupyterLab on notebooks/ (as root, as on course machines, jupyter wants --allow-root)."""
    import os
    from pathlib import Path

    import importlib.util

    if importlib.util.find_spec("jupyterlab") is None or importlib.util.find_spec("matplotlib") is None:
        fail("the course needs its extra: pip install -e \".[course]\" (JupyterLab, matplotlib, ipywidgets, ...)")
    notebooks = Path(__file__).resolve().parents[2] / "notebooks"
    if not notebooks.is_dir():
        fail(f"no notebooks/ beside the package at {notebooks.parent}; install from a clone: pip install -e .")
    cmd = [sys.executable, "-m", "jupyter", "lab", str(notebooks)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    if args.port:
        cmd.append(f"--port={args.port}")
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")       # a remote or headless machine: open the printed URL (README: SSH tunnel)
    if args.dry_run:
        print(" ".join(cmd))
        return
    os.execv(sys.executable, cmd)
