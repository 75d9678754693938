"""Quantization: fewer bytes per weight and per cached value (stage 7, in progress).

    gguf_blocks.py   the file's own 4-bit and 8-bit blocks (Q4_1, Q8_0), read without going through
                     float32 into packed tensors that dequantize to exactly what llama.cpp computes
"""
from .gguf_blocks import Q4Weight, Q8Weight, read_q4_1, read_q8_0

__all__ = ["Q4Weight", "Q8Weight", "read_q4_1", "read_q8_0"]
