"""Shared fixtures. The real model is loaded once per test session."""
import os

# Triton kernels (later stages) run on the CPU through the interpreter; it must be
# switched on before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`-n 2`) two workers share the machine's cores: one thread each, passed on
# to the servers, CLIs and notebook kernels they start, so the workers do not fight over a core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or min(2, os.cpu_count() or 1))

TRITON_FILES = {"test_triton_flash.py", "test_triton_paged.py", "test_quant_triton.py"}
TRITON_PARAMS = {"flash", "paged", "triton"}   # stages and attention backends that run Triton kernels


def pytest_ignore_collect(collection_path, config):
    from minillm.triton_support import HAS_TRITON

    return True if not HAS_TRITON and collection_path.name in TRITON_FILES else None


def pytest_collection_modifyitems(config, items):
    """Triton ships for Linux only: elsewhere its tests are skipped, saying so, and the rest still run."""
    from minillm.triton_support import HAS_TRITON

    if HAS_TRITON:
        return
    skip = pytest.mark.skip(reason="needs Triton (Linux only): pip install triton")
    for item in items:
        params = set(map(str, getattr(getattr(item, "callspec", None), "params", {}).values()))
        if item.get_closest_marker("triton") or params & TRITON_PARAMS:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model():
    import minillm

    return minillm.load_model()


@pytest.fixture(scope="session")
def native_model(model):
    """The course model with the native backend (C loops and blocks where this machine measured them faster;
    `minillm/backends/`): a copy that shares its weights."""
    from minillm.backends import apply_backend

    return apply_backend(model, "native")


@pytest.fixture(params=["torch", "native"])
def backend_model(request, model):
    """The course model on each backend: an equality test that takes it runs on both."""
    return model if request.param == "torch" else request.getfixturevalue("native_model")


class _QuantizedModels(dict):
    def __missing__(self, fmt):
        import minillm

        self[fmt] = minillm.load_model(quant=fmt)
        return self[fmt]


@pytest.fixture(scope="session")
def quantized():
    """The course model in each quantized format, loaded when a test first asks: quantized["q4_file"]."""
    return _QuantizedModels()


@pytest.fixture(scope="session")
def tokenizer():
    import minillm

    return minillm.load_tokenizer()


@pytest.fixture(scope="session")
def hf_model():
    """An independent implementation of the same file: transformers reading the GGUF (test-only)."""
    transformers = pytest.importorskip("transformers")
    import minillm

    path = minillm.find_model()
    m = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
    return m.eval().requires_grad_(False)
