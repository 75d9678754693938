"""The quantized CPU kernels under every CPU capability this machine supports, not only its best one.

ATen compiles its CPU kernels once per capability (default, AVX2, AVX-512 on x86) and runs the best one
the CPU has, unless ATEN_CPU_CAPABILITY names another when the process starts. The 4-bit kernel packs
its weights differently under each, so a layer built on one kind of CPU is checked on the others here:
the layer, kernel and block tests run again in a fresh process per capability, with the real model's
q4_file passes at every row count (q4 runs the same layers on other codes; int8's kernel packs nothing;
fbgemm, behind w8a8, picks its own instructions whatever ATen runs)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
X86 = ["default", "avx2", "avx512"]          # ATen's x86 capabilities, each a superset of the one before
TESTS = ["tests/test_quant_kernels.py", "tests/test_quant_blocks.py",
         "tests/test_kv_quant.py::test_values_come_back_within_half_a_step",
         "tests/test_kv_quant.py::test_int4_nibbles_hold_neighbouring_values"]


def supported_capabilities() -> list[str]:
    """ATen's capabilities this CPU can run, lowest first; the last is the one it runs by default."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    if best in X86:
        return X86[:X86.index(best) + 1]
    return ["default"] if best == "default" else ["default", best]


OTHERS = supported_capabilities()[:-1]       # the best one is what the rest of the suite runs


@pytest.mark.parametrize("capability", OTHERS or [pytest.param("default", marks=pytest.mark.skip(
    reason="this CPU runs ATen's default kernels only: the rest of the suite covers them"))])
def test_quantized_kernels_under_every_capability(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not real or q4_file",
                        *TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}:\n{r.stdout[-6000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-2000:]
