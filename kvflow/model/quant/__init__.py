"""Quantized weights served as they are stored: GGUF's block formats and int8 W8A8, packed once
at load into the panel layout of kvflow/csrc/gemm_quant.c and multiplied there."""
