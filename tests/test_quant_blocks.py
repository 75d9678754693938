"""The file's own quantized blocks (Q4_1, Q8_0) read into packed tensors: exactly the file's values."""
import gguf
import numpy as np
import pytest
import torch

import minillm
from minillm.quant import Q4Weight, read_q4_1, read_q8_0
from minillm.weights import gguf_reader, unpermute_rope_rows


@pytest.fixture(scope="module")
def tensors():
    return {t.name: t for t in gguf_reader(minillm.find_model()).tensors}


def test_every_block_dequantizes_bit_for_bit_like_gguf(tensors):
    kinds = {"Q4_1": read_q4_1, "Q8_0": read_q8_0}
    seen = {k: 0 for k in kinds}
    for t in tensors.values():
        if t.tensor_type.name not in kinds:
            continue
        w = kinds[t.tensor_type.name](t)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape).astype(np.float32)
        assert torch.equal(w.dequantize(), torch.from_numpy(ref)), t.name
        fields = (w.packed, w.scale, w.min) if t.tensor_type.name == "Q4_1" else (w.q, w.scale)
        assert sum(f.numel() * f.element_size() for f in fields) == t.data.nbytes   # the file's bytes, no more
        seen[t.tensor_type.name] += 1
    assert seen == {"Q4_1": 210, "Q8_0": 1}


def test_codes_follow_llama_cpps_nibble_order():
    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8)              # low nibble 1, high nibble 2
    w = Q4Weight(packed, torch.tensor([[2.0]]).half(), torch.tensor([[-1.0]]).half())
    assert w.codes().tolist() == [[1] * 16 + [2] * 16]                   # low nibbles: weights 0-15
    assert w.dequantize().tolist() == [[1.0] * 16 + [3.0] * 16]          # q * d + m


def test_rope_rows_permuted_equal_the_models_weights(tensors, model):
    cfg = model.cfg
    wq = read_q4_1(tensors["blk.0.attn_q.weight"])
    order = unpermute_rope_rows(torch.arange(wq.shape[0]), cfg.n_heads)
    fused = model.layers[0].attn.wqkv.weight                              # (q + k + v rows, dim)
    assert torch.equal(wq.permute_rows(order).dequantize(), fused[:wq.shape[0]])


def test_wrong_type_is_refused(tensors):
    with pytest.raises(ValueError, match="is Q4_1, not Q8_0"):
        read_q8_0(tensors["blk.0.attn_q.weight"])
    with pytest.raises(ValueError, match="not Q4_1"):
        read_q4_1(tensors["token_embd.weight"])
