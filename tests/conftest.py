"""Shared fixtures. The real model is loaded once per test session."""
import os

# Triton kernels (later stages) run on the CPU through the interpreter; it must be
# switched on before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def model():
    import minillm

    return minillm.load_model()


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
