"""One rule for the device: the GPU when there is one, the Triton interpreter only where there is none.
CI has no GPU, so these tests make torch say it has one and check what each notebook-facing function picks."""
import json
from pathlib import Path

import pytest
import torch

import minillm
from minillm.device import pick_device, use_triton_interpreter
from test_paged_torch import tiny_model

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda.is_available() says True; nothing can really be put on the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_gpu_is_the_default_where_there_is_one(gpu):
    assert pick_device() == torch.device("cuda")
    assert pick_device("cpu") == torch.device("cpu")


def test_the_cpu_is_the_default_without_one(no_gpu):
    assert pick_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no GPU"):
        pick_device("cuda")


def test_the_interpreter_only_without_a_gpu(monkeypatch, gpu):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert use_triton_interpreter() is False
    assert "TRITON_INTERPRET" not in __import__("os").environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert use_triton_interpreter() is True
    assert __import__("os").environ["TRITON_INTERPRET"] == "1"


@pytest.mark.parametrize("has_gpu, where", [(True, "cuda"), (False, "cpu")])
def test_load_model_puts_the_model_on_the_default_device(monkeypatch, has_gpu, where):
    moved = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
    monkeypatch.setattr(minillm.loading, "load_state", lambda path, dtype: (None, None, None))
    monkeypatch.setattr(minillm.loading, "build_model", lambda cfg, state, **kw: tiny_model())
    monkeypatch.setattr(minillm.Transformer, "to", lambda self, device: moved.append(device) or self)
    minillm.load_model()
    assert moved == [torch.device(where)]


def test_the_engine_runs_where_its_model_is():
    with pytest.raises(ValueError, match="the model is on cpu, not cuda"):
        minillm.LLM(tiny_model(), device="cuda")


def test_kernel_checks_put_their_inputs_on_the_gpu(gpu):
    """With a GPU the checks move their inputs there before any kernel sees them: on this CPU-only torch
    that move is what fails, where the old code handed CPU tensors to compiled Triton."""
    from minillm.course.kernel_checks import flash_kernel_checks

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        flash_kernel_checks()


def test_no_cpu_tensor_reaches_a_kernel_on_another_device(monkeypatch):
    """Every tensor the kernel checks hand to a kernel is on the device asked for ("meta" stands in for
    the GPU: tensors with shapes and no data)."""
    from minillm.attention import triton_flash
    from minillm.course import kernel_checks

    class Reached(Exception):
        pass

    seen = []

    def spy(*args, **kwargs):
        seen.extend(a.device.type for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
        raise Reached

    monkeypatch.setattr(triton_flash, "flash_attn_varlen", spy)
    monkeypatch.setattr(triton_flash, "decode_attention", spy)
    rand = lambda *shape: torch.randn(*shape).to("meta")                  # noqa: E731
    for check in (lambda: kernel_checks._prefill_error(rand, [1, 37], [1, 40], "meta"),
                  lambda: kernel_checks._decode_error(rand, [200, 64, 1], "meta")):
        with pytest.raises(Reached):
            check()
    assert len(seen) >= 9 and set(seen) == {"meta"}


@pytest.mark.parametrize("name", ["05_flash_attention", "06_paged_kv_cache"])
def test_kernel_notebooks_choose_the_interpreter_by_the_rule(name):
    cells = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"]
    first = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    assert "use_triton_interpreter()" in first
    assert first.index("use_triton_interpreter()") < first.index("import minillm\n")


def test_no_notebook_has_its_own_device_rule():
    for path in NOTEBOOKS.glob("*.ipynb"):
        code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        assert "torch.cuda.is_available()" not in code, path.name
        assert 'os.environ.setdefault("TRITON_INTERPRET"' not in code, path.name
