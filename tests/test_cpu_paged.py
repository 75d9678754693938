"""The CPU's paged decode kernel (`attention/cpu_paged.c`, built by `cpu_kernel.py`): pages read in place,
checked against a float64 reference on ragged, shuffled-table batches; the "cpu" backend in the engine."""
import pytest
import torch
from test_paged_torch import CASES, PROMPTS, engine_tokens, make_batch, reference, tiny_model

from minillm.attention import cpu_kernel
from minillm.attention.paged import check_backend
from minillm.attention.paged_torch import paged_attention, plan_paged_attention
from minillm.kv.quantized import QuantizedKV

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler builds the CPU kernel here")


def in_place(case, pool, tables, block_size):
    plan = plan_paged_attention([n for n, _ in case], [k for _, k in case], tables, block_size, "cpu", in_place=True)
    assert not plan.groups and plan.num_pages == 0                          # nothing is gathered for decodes
    return plan


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("H, H_kv, D", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (6, 2, 48), (40, 2, 16)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_kernel_matches_reference(case, H, H_kv, D, block_size):
    """Every head shape the kernel has a fast path for, one it has not (48 = 3 vectors), and 20 query
    heads per KV head (more than its 16 at once: two passes)."""
    pool, q, ks, vs, tables = make_batch(case, H, H_kv, D, block_size, torch.float32, seed=len(case) * H + D + 1)
    out = paged_attention(q.float(), pool.k[0], pool.v[0], in_place(case, pool, tables, block_size))
    err = (out.double() - reference(case, q, ks, vs)).abs().max().item()
    assert err < 1e-5, f"worst mismatch {err:.2e}"


@pytest.mark.parametrize("seed", range(4))
def test_kernel_on_fresh_ragged_batches(seed):
    """Random decode lengths 1..300 (across tile and page boundaries), random query strides as the
    engine's (a transposed view), a pool shared and shuffled."""
    g = torch.Generator().manual_seed(1000 + seed)
    n = int(torch.randint(1, 20, (1,), generator=g))
    case = [(1, int(k)) for k in torch.randint(1, 300, (n,), generator=g)]
    pool, q, ks, vs, tables = make_batch(case, 9, 3, 64, 16, torch.float32, seed=seed)
    qt = q.float().transpose(0, 1).contiguous().transpose(0, 1)             # (N, H, D), heads-major like the model's
    out = paged_attention(qt, pool.k[0], pool.v[0], in_place(case, pool, tables, 16))
    assert (out.double() - reference(case, q, ks, vs)).abs().max().item() < 1e-5


def test_short_chunks_are_read_in_place_and_long_ones_gathered():
    """A speculative step's chunks (the sampled token and its drafts) go to the kernel, one decode per query,
    each seeing the keys up to its own position; a chunk of more than IN_PLACE_QUERIES queries is gathered
    for SDPA. Both against the float64 reference."""
    case = [(1, 40), (5, 45), (16, 16), (17, 30), (9, 200), (40, 70), (2, 2)]
    pool, q, ks, vs, tables = make_batch(case, 9, 3, 64, 16, torch.float32, seed=11)
    plan = in_place(case, pool, tables, 16)
    rows, _, lens = plan.in_place
    assert len(rows) == 1 + 5 + 16 + 9 + 2 and [n for _, n, _, _ in plan.chunks] == [17, 40]
    assert lens[1:6].tolist() == [41, 42, 43, 44, 45]                        # query t of 5 over 45 keys
    out = paged_attention(q.float(), pool.k[0], pool.v[0], plan)
    assert (out.double() - reference(case, q, ks, vs)).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", CASES[1:])
def test_bfloat16_pages(case):
    """bfloat16 pages widened to float32 in the kernel: within bfloat16's rounding of the output."""
    pool, q, ks, vs, tables = make_batch(case, 9, 3, 64, 16, torch.bfloat16, seed=5)
    qb = q.bfloat16()
    ref = reference(case, qb.double(), [k.bfloat16().double() for k in ks], [v.bfloat16().double() for v in vs])
    out = paged_attention(qb, pool.k[0], pool.v[0], in_place(case, pool, tables, 16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_which_caches_the_kernel_reads():
    assert cpu_kernel.supports(torch.zeros(4, 16, 3, 64))
    assert cpu_kernel.supports(torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16))
    assert not cpu_kernel.supports(torch.zeros(4, 16, 3, 64, dtype=torch.float16))
    assert not cpu_kernel.supports(torch.zeros(4, 16, 3, 24))                   # head_dim not a multiple of 16
    assert not cpu_kernel.supports(torch.zeros(4, 3, 16, 64).transpose(1, 2))   # not contiguous
    assert not cpu_kernel.supports(QuantizedKV.zeros((4, 16, 3, 64), "int8", torch.float32, "cpu"))


def test_backend_choice(monkeypatch):
    assert check_backend("auto", on_gpu=False, native=True) == "cpu"          # a model of the native backend
    assert check_backend("auto", on_gpu=False) == "torch"                     # a plain model
    assert check_backend("torch", on_gpu=False) == "torch"
    with pytest.raises(ValueError, match="'torch'"):
        check_backend("cpu", on_gpu=True)
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)              # a machine with no compiler
    assert check_backend("auto", on_gpu=False, native=True) == "torch"
    with pytest.raises(ValueError, match="C compiler"):
        check_backend("cpu", on_gpu=False)


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_engine_gives_the_same_tokens_with_cpu_and_torch(tokenizer, kv_cache_dtype):
    """Decodes, chunked prompts and mixed steps; an int8 cache, which the kernel does not read, goes
    through the gather in both."""
    from minillm.generate import generate
    from minillm.sampling import SamplingParams

    model = tiny_model()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results = {backend: engine_tokens(model, tokenizer, backend, params, kv_cache_dtype=kv_cache_dtype)
               for backend in ("torch", "cpu")}
    assert results["cpu"] == results["torch"]
    if kv_cache_dtype is None:
        assert results["cpu"] == [generate(model, tokenizer, p, params, stage="naive").token_ids for p in PROMPTS]
