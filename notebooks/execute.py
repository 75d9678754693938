"""Execute course notebooks in place, top to bottom, and write at the top of each how long it ran and its
peak memory on this machine (the kernel's high-water mark of resident memory).

    python notebooks/execute.py notebooks/02_sampling.ipynb [more.ipynb ...]
"""
from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

MARK = "*On this machine"   # the line this script owns in the first markdown cell


def run_one(path: Path) -> tuple[float, int]:
    """Execute one notebook in a child process; (seconds, peak resident bytes of the largest child)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    "--ExecutePreprocessor.timeout=1800", str(path)], check=True)
    seconds = time.perf_counter() - t0
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss   # Linux: KiB, the largest descendant (the kernel)
    return seconds, kib * 1024


def stamp(path: Path, seconds: float, peak: int) -> None:
    from minillm.course.bench import machine_label

    nb = json.loads(path.read_text())
    nb["metadata"]["kernelspec"]["display_name"] = "Python 3 (ipykernel)"   # what ipykernel installs
    minutes, secs = divmod(round(seconds), 60)
    took = f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"
    line = (f"{MARK} ({machine_label()}) it runs top to bottom in {took} and peaks at "
            f"{peak / 2**30:.1f} GiB of memory.*")
    first = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    text = "".join(first["source"])
    text = re.sub(r"\n\n\*On this machine.*?\*$", "", text, flags=re.S)   # drop an older stamp
    first["source"] = (text.rstrip("\n") + "\n\n" + line).splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    print(f"{path.name}: {line}")


if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[1:] == []:        # one child process per notebook: a clean high-water mark
        for p in sys.argv[1:]:
            subprocess.run([sys.executable, __file__, p], check=True)
    else:
        path = Path(sys.argv[1])
        stamp(path, *run_one(path))
