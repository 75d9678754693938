"""Backends (`minillm/backends/`): the plain model knows none of them, a backend is applied from outside to a
copy that shares the weights, its races run when it is applied (and are remembered), and the native build
fails once, in one line, where no compiler works."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm import cbuild
from minillm.backends import apply_backend, backend_of, describe, plain_model, races, report
from minillm.backends.native import c_layers
from test_paged_torch import tiny_model

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"
NATIVE_MODULES = tuple(f"minillm.backends.{m}" for m in ("native", "matvec", "c_block", "packed", "layers", "races")) + (
    "minillm.cbuild", "minillm.attention.cpu_kernel")


def import_graph() -> dict[str, set[str]]:
    """minillm's modules and the minillm modules each imports, at the top or inside a function."""
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for mod, f in mods.items():
        here = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "minillm.backends.native" in graph["minillm.backends"]       # the walk sees function-level imports
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)


def loaded_after(code: str) -> list[str]:
    """The native modules a fresh Python has loaded after running code."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(m for m in sys.modules "
                          f"if m.startswith({NATIVE_MODULES!r}))))"], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_plain_model_loads_no_native_code():
    assert loaded_after("import minillm.model") == []
    assert loaded_after("import minillm, minillm.generate, minillm.engine") == []
    assert loaded_after(
        "from minillm.config import ModelConfig\nfrom minillm.model import Transformer\n"
        "tiny_model = lambda: Transformer(ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, "
        "ffn_dim=64, vocab_size=49152)).eval().requires_grad_(False)\nfrom minillm.generate import generate\n"
        "from minillm.sampling import SamplingParams\nimport minillm\n"
        "generate(tiny_model(), minillm.load_tokenizer(), [1, 2, 3], SamplingParams(max_tokens=4), stage='kv')\n"
        "from minillm.stages import PagedRunner\n"
        "PagedRunner(tiny_model(), attention='auto').prefill([1, 2, 3])"
    ) == []


def test_a_backend_is_a_copy_that_shares_the_weights():
    plain = tiny_model()
    assert apply_backend(plain, "torch") is plain and backend_of(plain) == "torch"
    fast = apply_backend(plain, "native")
    assert backend_of(fast) == "native" and plain_model(fast) is plain and backend_of(plain) == "torch"
    assert type(plain.layers[0]).__name__ == "Block" and type(plain.layers[0].attn.wqkv) is torch.nn.Linear
    ptrs = {t.data_ptr() for t in plain.state_dict().values()}
    assert {t.data_ptr() for t in fast.state_dict().values()} == ptrs            # no weight copied
    assert set(fast.state_dict()) - set(plain.state_dict()) == {"lm_head.weight"}   # the tied head, as a layer
    assert apply_backend(fast, "native") is fast and apply_backend(fast, "torch") is plain
    lines = describe(fast)
    assert lines[0] == "backend native:" and any("float32 products" in line for line in lines)
    assert describe(plain) == ["backend torch: PyTorch's operators"]
    ids = torch.randint(0, 300, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids), plain(ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backend must be one of"):
        apply_backend(plain, "fast")


def test_races_run_when_applied_and_are_remembered(tmp_path, monkeypatch, tokenizer):
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = report(apply_backend(tiny_model(), "native"))["kernels"]["float32 products"]["measured"]
    second = report(apply_backend(tiny_model(), "native"))["kernels"]["float32 products"]["measured"]
    if first is None:
        pytest.skip("no C compiler builds the C loops here: nothing to race")
    assert first["remembered"] is False and second["remembered"] is True
    assert {k: v for k, v in first.items() if k != "remembered"} == {k: v for k, v in second.items() if k != "remembered"}
    assert list((tmp_path / "minillm" / "races").glob("float_products-*.json"))
    fast = apply_backend(tiny_model(), "native")

    def no_race(*a, **k):
        raise AssertionError("a race ran inside a request")
    for name in ("race", "float_products", "quantized_products", "packed_products", "remembered"):
        monkeypatch.setattr(races, name, no_race)
    for stage in ("naive", "kv"):
        generate(fast, tokenizer, [1, 2, 3], SamplingParams(max_tokens=4), stage=stage)
    from minillm.stages import PagedRunner

    runner = PagedRunner(fast, attention="auto")
    runner.prefill([1, 2, 3])
    runner.decode(4)


def test_the_engine_attention_follows_the_backend():
    from minillm.engine import LLMEngine
    from minillm.attention import cpu_kernel

    plain = tiny_model()
    assert LLMEngine(plain, None, num_blocks=8, verbose=False).runner.attention == "torch"
    fast = LLMEngine(apply_backend(plain, "native"), None, num_blocks=8, verbose=False)
    assert fast.runner.attention == ("cpu" if cpu_kernel.available() else "torch")


def test_llm_applies_auto_to_a_copy(tokenizer):
    from minillm import LLM

    plain = tiny_model(vocab_size=49152)
    llm = LLM(plain, tokenizer, kv_cache_memory=8 << 20)
    assert backend_of(llm.model) == "native" and backend_of(plain) == "torch"
    assert backend_of(LLM(plain, tokenizer, backend="torch", kv_cache_memory=8 << 20).model) == "torch"


# ------------------------------------------------------------------ the native build


C_SOURCE = "int add(int a, int b) { return a + b; }\n"


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """A C file of its own, a cache of its own, and no remembered load: each test builds from nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MINILLM_NO_CPU_KERNEL", raising=False)
    cbuild._load.cache_clear()
    cbuild._say_once.cache_clear()
    source = tmp_path / "add.c"
    source.write_text(C_SOURCE)
    yield source
    cbuild._load.cache_clear()


SIGS = {"add": [("a", "i32"), ("b", "i32")]}


def test_no_compiler_on_path_is_said_once(fresh_build, monkeypatch, capsys):
    monkeypatch.setattr(cbuild, "compilers", lambda: [])
    assert cbuild.load(fresh_build, SIGS) is None
    assert cbuild.load(fresh_build, SIGS) is None
    cbuild._load.cache_clear()
    assert cbuild.load(fresh_build, SIGS) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no C compiler on PATH" in err[0] and "torch kernels are used instead" in err[0]


def test_a_failing_compiler_is_tried_once_per_key(fresh_build, tmp_path, monkeypatch, capsys):
    calls = tmp_path / "calls"
    cc = tmp_path / "badcc"
    cc.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'badcc: cannot compile' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setattr(cbuild, "compilers", lambda: [str(cc)])
    assert cbuild.load(fresh_build, SIGS) is None
    tried = len(calls.read_text().splitlines())
    assert tried == 1 + len(cbuild.FLAG_SETS)                     # --version, then each flag set once
    cbuild._load.cache_clear()                                    # a new process, as far as the cache knows
    assert cbuild.load(fresh_build, SIGS) is None
    assert len(calls.read_text().splitlines()) == tried           # remembered: not tried again
    failed = list((tmp_path / "cache" / "minillm" / "kernels").glob("*.failed"))
    assert failed and "cannot compile" in failed[0].read_text()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "badcc failed to build add.c" in err


@pytest.mark.skipif(not cbuild.compilers(), reason="no C compiler here")
def test_a_corrupt_cached_library_is_built_again(fresh_build):
    """A library cut short (a build or a copy interrupted) where the cache expects one: built again."""
    cc = cbuild.compilers()[0]
    lib = cbuild.cache_dir() / f"add-{cbuild.build_key(fresh_build, cc, cbuild.FLAG_SETS[0])}.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not a library")
    built = cbuild.load(fresh_build, SIGS)
    if built is None:
        pytest.skip("the compiler here builds nothing")
    assert built.call("add", a=2, b=3) == 5
    with pytest.raises(TypeError, match="missing"):
        built.call("add", a=2)


@pytest.mark.skipif(not cbuild.compilers(), reason="no C compiler here")
def test_two_sources_of_one_name_are_two_builds(fresh_build, tmp_path):
    """An older version of a kernel, built beside the current one to race it, is its own build."""
    other = tmp_path / "older" / "add.c"
    other.parent.mkdir()
    other.write_text(C_SOURCE.replace("a + b", "a + b + 1"))
    now, before = cbuild.load(fresh_build, SIGS), cbuild.load(other, SIGS)
    if now is None or before is None:
        pytest.skip("the compiler here builds nothing")
    assert (now.call("add", a=2, b=3), before.call("add", a=2, b=3)) == (5, 6)


def test_the_build_key_names_the_cpu():
    key = cbuild.cpu_key()
    assert torch.cpu.get_capabilities()["architecture"] in key or key.split()[0]
    caps = [k for k, v in torch.cpu.get_capabilities().items() if v is True]
    assert all(c in key for c in caps)


def test_c_layers_of_a_plain_model_are_none():
    assert c_layers(tiny_model()) == []
