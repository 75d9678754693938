"""Quantization: fewer bytes per weight (stage 7). The KV cache's int8 / 4-bit storage is in
`minillm.kv.quantized`.

    gguf_blocks.py   the file's own 4-bit and 8-bit blocks (Q4_1, Q8_0), read without going through
                     float32 into packed tensors that dequantize to exactly what llama.cpp computes
    linear.py        quantized linear layers (int8, w8a8, 4-bit) and the CPU kernels they call
    triton_matmul.py the GPU kernel: dequantize 8- or 4-bit weight tiles in registers and multiply
    apply.py         quantize_model(model, "int8" | "w8a8" | "q4" | "q4_file"): swap them in, in place
    smoothquant.py   per-channel scales that move activation outliers into the weights (for w8a8)
"""
from ..model import weight_bytes  # bytes of parameters and buffers: quantized codes and scales too
from .apply import FORMATS, check_format, quantize_model
from .gguf_blocks import Q4Weight, Q8Weight, read_q4_1, read_q8_0
from .linear import Int8Linear, Q4Linear, W8A8Linear

__all__ = ["FORMATS", "Int8Linear", "Q4Linear", "Q4Weight", "Q8Weight", "W8A8Linear", "check_format",
           "quantize_model", "read_q4_1", "read_q8_0", "weight_bytes"]
