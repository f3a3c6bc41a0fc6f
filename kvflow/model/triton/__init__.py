"""Paged attention for NVIDIA GPUs in Triton: the KV write by slot mapping (kv_write.py), decode
attention split over the KV length (paged_decode.py) and varlen prompt/mixed attention
(paged_prefill.py); and the layer's small fused ops (fused_ops.py: add+RMSNorm, RoPE, SiLU-mul). They read and write kvflow's own cache tiles (kvflow/attention/kv_layout.py),
so the GPU cache is the CPU one on another device. `attention.py` here is the backend's entry
point with the signature of kvflow/attention's backends (c_kernels.CAttention's call).

Importing this package imports triton; kernels.py does so only when the device is cuda. On a
CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 when they are decorated),
which is how tests/test_triton_attention.py checks them."""
