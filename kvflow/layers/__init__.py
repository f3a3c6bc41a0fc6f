"""What model families share: the attention layer over the paged KV cache (it writes K/V,
attends, holds an fp8 cache's scales and declares its KV cache spec), rotary embeddings, the
mixture-of-experts block, and empty weights for a loader to fill. A family file in
kvflow/models/ builds its decoder from these."""
