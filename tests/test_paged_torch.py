"""The engine's two attention backends on packed, paged batches: PyTorch (gathered pages + SDPA,
the CPU path) against a float64 reference, and the Triton kernel (through the interpreter)
against the same; then the whole engine with either backend on a small random model."""
import pytest
import torch
from helpers import pool_io

from minillm.attention import cpu_kernel, naive_attention
from minillm.attention.paged_torch import paged_attention, plan_paged_attention, workspace_for
from minillm.config import ModelConfig
from minillm.kv import BlockPool

# (new queries, keys) per request: decodes, chunks over a cached prefix, whole prompts,
# lengths on and across block boundaries
CASES = [
    [(1, 1)],
    [(1, 17), (1, 5), (1, 32)],
    [(7, 7)],
    [(5, 21), (1, 9), (16, 16), (1, 33), (3, 4)],
    [(1, 64), (13, 40), (1, 1), (2, 2)],
    [(1, 3), (1, 90), (1, 40), (1, 20), (1, 88)],      # decodes of very different lengths: several groups
]


def make_batch(case, H, H_kv, D, block_size, dtype, seed):
    """A pool shared with a blocker sequence, block tables shuffled, K/V written at each request's slots."""
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=H, n_kv_heads=H_kv, head_dim=D, ffn_dim=8, vocab_size=8)
    pool = BlockPool(cfg, num_blocks=128, block_size=block_size, dtype=dtype)
    pool.free = type(pool.free)(torch.randperm(128, generator=g).tolist())   # pages in random order
    pool.allocate("blocker", 3)
    ks, vs, tables = [], [], []
    for i, (_, k_len) in enumerate(case):
        slots = pool.allocate(i, k_len)
        pool.append_slots("blocker", block_size)                           # interleave the pages
        k = torch.randn(k_len, H_kv, D, generator=g, dtype=torch.float64)
        v = torch.randn(k_len, H_kv, D, generator=g, dtype=torch.float64)
        pool_io.write(pool, 0, slots, k.to(dtype), v.to(dtype))
        ks.append(k)
        vs.append(v)
        tables.append(pool.tables[i])
    q = torch.randn(sum(n for n, _ in case), H, D, generator=g, dtype=torch.float64)
    return pool, q, ks, vs, tables


def reference(case, q, ks, vs):
    """float64, one request at a time, the full score matrix (causal, bottom-right)."""
    outs, start = [], 0
    for (n, _), k, v in zip(case, ks, vs):
        qi = q[start:start + n].transpose(0, 1)[None]                      # (1, H, n, D)
        outs.append(naive_attention(qi, k.transpose(0, 1)[None], v.transpose(0, 1)[None])[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("H, H_kv, D", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_backend_matches_reference(case, H, H_kv, D, block_size):
    pool, q, ks, vs, tables = make_batch(case, H, H_kv, D, block_size, torch.float32, seed=len(case) * H + D)
    plan = plan_paged_attention([n for n, _ in case], [k for _, k in case], tables, block_size, "cpu")
    plan.workspace = (workspace_for(plan, pool.k[0], None), workspace_for(plan, pool.v[0], None))
    out = paged_attention(q.float(), pool.k[0], pool.v[0], plan)
    ref = reference(case, q, ks, vs)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-5, f"worst mismatch {err:.2e}"
    plan.workspace = None                                                # without reused buffers: same
    torch.testing.assert_close(paged_attention(q.float(), pool.k[0], pool.v[0], plan), out)


@pytest.mark.parametrize("in_place", [False, True], ids=["gathered", "C kernel"])
@pytest.mark.parametrize("case", CASES[1:])
def test_tables_longer_than_the_keys(case, in_place):
    """A request may hold blocks past its keys (room reserved for speculative tokens): they are ignored."""
    if in_place and not cpu_kernel.available():
        pytest.skip("no C compiler builds the CPU kernel here")
    pool, q, ks, vs, tables = make_batch(case, 4, 2, 16, 4, torch.float32, seed=3)
    for i in range(len(case)):
        pool.append_slots(i, 9)                                            # 2-3 more blocks, never read
    tables = [pool.tables[i] for i in range(len(case))]
    plan = plan_paged_attention([n for n, _ in case], [k for _, k in case], tables, 4, "cpu", in_place)
    out = paged_attention(q.float(), pool.k[0], pool.v[0], plan)
    assert (out.double() - reference(case, q, ks, vs)).abs().max().item() < 1e-5


@pytest.mark.triton
@pytest.mark.parametrize("case", CASES[1:4])
def test_triton_backend_matches_reference(case):
    from minillm.attention.triton_flash import flash_attn_varlen

    pool, q, ks, vs, tables = make_batch(case, 9, 3, 64, 16, torch.float32, seed=7)
    q_lens, k_lens = [n for n, _ in case], [k for _, k in case]
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    cu_k = torch.tensor([0] + k_lens).cumsum(0).int()
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = flash_attn_varlen(q.float(), pool.k[0], pool.v[0], cu_q, cu_k, max(q_lens), max(k_lens),
                            causal=True, block_table=table)
    err = (out.double() - reference(case, q, ks, vs)).abs().max().item()
    assert err < 1e-5, f"worst mismatch {err:.2e}"


def tiny_model(seed=0, vocab_size=300):
    """Two layers of width 32 with random weights. vocab_size=49152 (the course tokenizer's) makes a model
    that answers any text the tokenizer writes: a fast stand-in behind a server."""
    from minillm.model import build_model

    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, vocab_size=vocab_size,
                      max_seq_len=256)
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.3                      # noqa: E731
    state = {"tok_emb.weight": w(vocab_size, 32), "norm.weight": torch.ones(32)}
    for i in range(2):
        a, m = f"layers.{i}.attn.", f"layers.{i}.mlp."
        state.update({a + "wq.weight": w(32, 32), a + "wk.weight": w(16, 32), a + "wv.weight": w(16, 32),
                      a + "wo.weight": w(32, 32), m + "w_gate.weight": w(64, 32), m + "w_up.weight": w(64, 32),
                      m + "w_down.weight": w(32, 64), f"layers.{i}.attn_norm.weight": torch.ones(32),
                      f"layers.{i}.ffn_norm.weight": torch.ones(32)})
    return build_model(cfg, state)


PROMPTS = [[5, 9, 200, 17, 3], list(range(10, 40)), [250], list(range(100, 119))]   # chunked at a budget of 12


def engine_tokens(model, tokenizer, attention: str, params, **options) -> list[list[int]]:
    """PROMPTS through the engine (blocks of 4, a budget of 12 tokens: chunks, decodes and mixed steps)."""
    from minillm.engine import LLMEngine

    engine = LLMEngine(model, tokenizer, attention=attention, block_size=4, num_blocks=64, max_num_batched_tokens=12,
                       **options)
    assert engine.runner.attention == attention
    for i, p in enumerate(PROMPTS):
        engine.add_request(i, p, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [finals[i] for i in range(len(PROMPTS))]


@pytest.mark.triton
def test_engine_gives_the_same_tokens_with_either_backend(tokenizer):
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    model = tiny_model()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = {backend: engine_tokens(model, tokenizer, backend, params) for backend in ("torch", "triton")}
    naive = [generate(model, tokenizer, p, params, stage="naive").token_ids for p in PROMPTS]
    assert results["torch"] == naive
    assert results["triton"] == naive


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_every_paged_backend_speaks_the_same_interface(name):
    """One class per file, one registry: plan, write and attend, and whether CUDA graphs may capture it
    (with the hooks they need where they may)."""
    from minillm.attention.paged import BACKENDS, make_backend

    if name == "cpu" and not cpu_kernel.available():
        pytest.skip("no C compiler builds the CPU kernel here")
    backend = make_backend(name)
    assert backend.name == name and set(BACKENDS) == {"cpu", "torch", "triton"}
    for method in ("plan", "write", "attend"):
        assert callable(getattr(backend, method))
    assert backend.captures == (name == "triton")
    if backend.captures:
        for method in ("static_buffers", "static_plan", "fill"):
            assert callable(getattr(backend, method))
