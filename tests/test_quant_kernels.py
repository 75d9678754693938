"""Stage 7's CPU kernels: each quantized layer multiplies by exactly the weight it says it holds, on
ragged shapes, at every row count where a kernel switches (1, 16, 17, 64), through each of its paths.

ATen packs 4-bit weights differently for each CPU capability (AVX-512, AVX2, default), and picks the
capability when it starts: test_cpu_capabilities.py runs this file again under every capability this
CPU supports (ATEN_CPU_CAPABILITY), so an AVX-512 machine checks the AVX2 and default layouts too."""
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from minillm.kv import KVCache
from minillm.quant import Int8Linear, Q4Linear, Q4Weight, W8A8Linear
from minillm.quant.linear import SMALL_ROWS, cpu_has_vnni, eight_bit_sums_overflow, kernel_agrees, quantize_q4_1
from minillm.course.quality import KL_BOUND, heldout_ids, next_token_logprobs
from minillm.stages import KVCacheRunner

SHAPES = [(64, 32), (192, 96), (128, 576), (40, 64)]   # (out, in); 40 rows: no packed CPU kernel (needs 64k)
ROWS = [1, 3, SMALL_ROWS, SMALL_ROWS + 1, 37, 64]       # both sides of the kernel switch
SWITCH_ROWS = [64, SMALL_ROWS + 1, SMALL_ROWS, 1]       # the passes the end-to-end test makes


def rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def test_the_capability_asked_for_is_the_one_running():
    """Under ATEN_CPU_CAPABILITY (set by test_cpu_capabilities.py) ATen must really run that capability:
    it falls back silently to its best one when asked for a name it does not know."""
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    if not asked:
        pytest.skip("ATEN_CPU_CAPABILITY is not set: this run uses the CPU's best capability")
    assert torch.backends.cpu.get_cpu_capability().lower() == asked.lower()


@pytest.mark.parametrize("out,n", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("many_rows", ["kernel", "dequantize"])
def test_weight_only_layers_multiply_by_their_dequantized_weight(out, n, rows, many_rows):
    g = torch.Generator().manual_seed(out * 1000 + n + rows)
    w = torch.randn(out, n, generator=g) * 0.05
    x = torch.randn(2, rows, n, generator=g)                          # (B, T, in): any leading shape
    for layer in (Int8Linear.from_float(w), Q4Linear.from_float(w)):
        layer.many_rows = many_rows                                   # each CPU takes one; test both
        ref = F.linear(x, layer.dequantize())                         # (B, T, out)
        y = layer(x)
        assert y.shape == ref.shape and y.dtype == x.dtype
        assert rel_err(y, ref) < 1e-2, type(layer).__name__           # bfloat16 activations: ~3e-3
        assert rel_err(y, F.linear(x, w)) < (1e-2 if isinstance(layer, Int8Linear) else 0.15)   # and near w


@pytest.mark.parametrize("out,n", SHAPES)
def test_quantized_weights_are_close_to_the_float_ones(out, n):
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(out + n))
    int8 = Int8Linear.from_float(w)
    assert (int8.dequantize() - w).abs().max() <= int8.scale.max() / 2 + 1e-6        # round to nearest
    w4 = quantize_q4_1(w)
    d = w4.scale.float().repeat_interleave(32, dim=1)
    assert ((w4.dequantize() - w).abs() <= d / 2 + 1e-3).all()                     # half a step (+ float16 m)
    assert rel_err(Q4Linear(w4).dequantize(), w4.dequantize()) < 5e-3               # the format's own values


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("rows", [1, SMALL_ROWS + 1])
def test_larger_groups_multiply_by_their_own_weight(group, rows):
    """Groups of 64 or 128 ("q4" uses 64): one scale and minimum per group, the codes still packed in blocks
    of 32; ATen's kernel (told the group), and the blocks a block-by-block kernel reads, give that weight."""
    g = torch.Generator().manual_seed(group + rows)
    w = torch.randn(128, 256, generator=g) * 0.05
    w4 = quantize_q4_1(w, group)
    assert w4.group == group and w4.scale.shape == (128, 256 // group)
    assert ((w4.dequantize() - w).abs() <= w4.scale.float().repeat_interleave(group, 1) / 2 + 1e-3).all()
    d, m = w4.per_block()                                                          # (out, in / 32) each
    assert torch.equal(Q4Weight(w4.packed, d, m).dequantize(), w4.dequantize())
    layer = Q4Linear(w4)
    assert layer.cpu_kernel and layer.group == group
    assert torch.equal(layer.block_scale, d) and torch.equal(layer.block_min, m)   # the GPU kernel's, made once
    x = torch.randn(rows, 256, generator=g)
    for many_rows in ("kernel", "dequantize"):
        layer.many_rows = many_rows
        assert rel_err(layer(x), F.linear(x, layer.dequantize())) < 1e-2
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_1(w, 48)


def test_codes_survive_the_kernel_layout():
    w4 = quantize_q4_1(torch.randn(192, 96, generator=torch.Generator().manual_seed(1)))
    layer = Q4Linear(w4)
    assert torch.equal(layer.codes(), w4.codes())
    # the kernel's private copy, read through the kernel itself: x = I gives every weight it multiplies
    # by, (q - 8) s + z, from which the codes come back whatever the layout this CPU packed them in
    wk = layer._kernel(torch.eye(96)).float().T                                    # (out, in)
    d = w4.scale.float().repeat_interleave(32, dim=1)
    m = w4.min.float().repeat_interleave(32, dim=1)
    assert torch.equal(torch.round((wk - m) / d).clamp(0, 15).to(torch.uint8), w4.codes())


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("reduce_range", [False, True])
def test_w8a8_gives_each_token_its_own_scale(rows, reduce_range):
    """One huge token must not flatten the others: the fbgemm kernel equals the per-token emulation."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g) * 0.05
    x = torch.randn(rows, 64, generator=g)
    x[0] *= 1000                                                      # an outlier token
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)               # 8 bits overflow without VNNI
        layer = W8A8Linear(w, smooth=torch.rand(64, generator=g) + 0.5, reduce_range=reduce_range)
    y = layer(x)
    packed, layer.packed = layer.packed, None                         # the float emulation of the same math
    ref = layer(x)
    layer.packed = packed
    for r in range(rows):
        assert rel_err(y[r], ref[r]) < 3e-2, f"token {r}"
    if rows > 1:
        assert rel_err(y[1:], F.linear(x[1:], w)) < 5e-2              # small tokens stay accurate


def test_w8a8_token_result_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(7)
    layer = W8A8Linear(torch.randn(128, 64, generator=g) * 0.05)
    x = torch.randn(9, 64, generator=g)
    x[3] *= 50
    batched = layer(x)
    for r in range(9):
        assert torch.equal(layer(x[r:r + 1])[0], batched[r])


def test_only_x86_without_vnni_needs_7_bit_activations(monkeypatch):
    """The 16-bit pair sums that overflow are fbgemm's AVX2 path: an ARM CPU (an Apple-silicon Mac) keeps 8 bits."""
    import platform

    import minillm.quant.linear as linear

    for machine, overflows in (("arm64", False), ("aarch64", False), ("x86_64", not cpu_has_vnni()),
                               ("AMD64", not cpu_has_vnni())):
        monkeypatch.setattr(platform, "machine", lambda machine=machine: machine)
        linear.eight_bit_sums_overflow.cache_clear()
        assert linear.eight_bit_sums_overflow() == overflows, machine
    linear.eight_bit_sums_overflow.cache_clear()


def test_w8a8_keeps_fbgemm_only_where_its_sums_do_not_overflow():
    """Without AVX512-VNNI fbgemm adds pairs of 8-bit products in 16 bits: with 8-bit activations a row
    of ones overflows. The default bits hold on this CPU; 8 bits asked for where they overflow fall back
    to the emulation, saying so."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(256, 576, generator=g) * 0.05
    layer = W8A8Linear(w)
    assert layer.packed is not None and layer.reduce_range == eight_bit_sums_overflow()
    ones = torch.ones(1, 576)
    assert rel_err(layer(ones), F.linear(ones, layer.dequantize())) < 2e-2
    if eight_bit_sums_overflow():
        with pytest.warns(RuntimeWarning, match="linear_dynamic"):
            eight = W8A8Linear(w, reduce_range=False)
        assert eight.packed is None and not eight.reduce_range                     # 8 bits, emulated
        assert rel_err(eight(ones), F.linear(ones, eight.dequantize())) < 2e-2


def test_a_kernel_that_disagrees_with_its_weight_is_not_used():
    """A layout read wrongly (or a kernel broken on some CPU) must never compute: the probe finds it."""
    w4 = quantize_q4_1(torch.randn(128, 64, generator=torch.Generator().manual_seed(2)))
    layer = Q4Linear(w4)
    assert layer.cpu_kernel
    scrambled = layer.kernel_packed.flip(0)
    with pytest.warns(RuntimeWarning, match="_weight_int4pack_mm_for_cpu"):
        ok = kernel_agrees(lambda x: torch._weight_int4pack_mm_for_cpu(
            x.bfloat16(), scrambled, 32, layer.kernel_scale_zero), layer.dequantize(), "_weight_int4pack_mm_for_cpu")
    assert not ok

    def broken(x):
        raise NotImplementedError("no kernel here")
    with pytest.warns(RuntimeWarning, match="fails"):
        assert not kernel_agrees(broken, layer.dequantize(), "broken")


def test_int8_kernel_is_never_called_on_rows_it_would_overrun():
    """in_features not a multiple of 16: ATen's AVX-512 int8 kernel reads past each row (garbage, or a
    segmentation fault that no probe can catch), so the layer multiplies by its dequantized weight."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 200, generator=g) * 0.05
    layer = Int8Linear.from_float(w)
    assert not layer.cpu_kernel
    x = torch.randn(3, 200, generator=g)
    assert rel_err(layer(x), F.linear(x, layer.dequantize())) < 1e-2
    assert Int8Linear.from_float(torch.randn(64, 192, generator=g)).cpu_kernel == Int8Linear.from_float(
        torch.randn(64, 256, generator=g)).cpu_kernel                 # multiples of 16: probed as before


def test_int8_rows_are_the_row_absmax_grid_exactly():
    """from_float avoids temporaries; the codes and scales must be what the plain formula gives."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 2, 300)[:, None]
    w[5] = 0                                                           # a row of zeros keeps a tiny scale
    before = w.clone()
    layer = Int8Linear.from_float(w)
    assert torch.equal(w, before)                                      # rounding in place touches a copy only
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    assert torch.equal(layer.scale, scale)
    assert torch.equal(layer.q, torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))


@pytest.mark.parametrize("rows", [1, 5, SMALL_ROWS + 1, 40])
@pytest.mark.parametrize("many_rows", ["kernel", "dequantize"])
def test_the_head_decides_near_ties_as_a_float32_head(rows, many_rows):
    """An output head whose logits come back in bfloat16 (8 bits) recomputes its top few in float32: they
    equal the float32 product of the int8 weight, and the argmax is the float32 head's, even where the
    best two logits differ by less than bfloat16 can tell apart."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(512, 64, generator=g)
    w[1] = w[0] * (1 + 2 ** -12)                       # two rows whose logits nearly tie
    x = torch.randn(rows, 64, generator=g)
    x = w[0] + 0.3 * x                                 # ... and win: x is close to both
    head = Int8Linear.from_float(w)
    head.many_rows = many_rows
    exact = F.linear(x, head.dequantize())             # (rows, out) float32 head, same int8 weight
    assert (exact.argmax(-1) == 1).all()               # row 1 wins, by 2^-12 of its logit
    head.rescore_top = 4
    y = head(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y[:, :2], exact[:, :2], rtol=1e-5, atol=1e-5)
    assert (y.argmax(-1) == 1).all()


@pytest.fixture(scope="module")
def text(tokenizer):
    return heldout_ids(tokenizer, max_tokens=sum(SWITCH_ROWS))


@pytest.fixture(scope="module")
def reference(model, text):
    return next_token_logprobs(model, text)                            # (T, vocab) float32, one pass


@pytest.mark.parametrize("fmt", ["q4_file", "q4", "int8", "w8a8"])
def test_real_model_stays_within_its_bound_at_every_row_count(quantized, reference, text, fmt):
    """The text goes in as passes of 64, 17, 16 and 1 tokens through the KV cache (a prefill chunk, the
    smallest many-row pass, the largest few-row one, a decode step); every pass's next-token
    distributions stay within the format's KL bound of float32's."""
    model = quantized[fmt]
    runner = KVCacheRunner(model)
    runner.cache = KVCache(model.cfg, 1, len(text), model.dtype, model.device)   # empty: every pass extends it
    start = 0
    for rows in SWITCH_ROWS:
        logp = runner.extend(text[start:start + rows]).float().log_softmax(-1)   # (rows, vocab)
        ref = reference[start:start + rows]
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        assert kl < KL_BOUND[fmt], f"{fmt}: {rows}-row pass at token {start}: KL {kl:.4f}"
        start += rows
