"""Which layers attend through a sliding window, and the RoPE and scaling constants that go
with them (Gemma 3's interleaved local/global layers, Mistral's `sliding_window`, Qwen2's
`use_sliding_window` / `max_window_layers`), read from an HF config or GGUF metadata.

No torch here: the arch config (and through it the scheduler's KV cache groups) reads it."""
from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3 = "Gemma3ForCausalLM"


def hf_pattern_fields(cfg: dict, architecture: str) -> dict:
    """LlamaArchConfig fields for windows, local RoPE and soft-capping from an HF config
    (empty for a model with none of them)."""
    fields: dict = {}
    window = cfg.get("sliding_window")
    use_window = cfg.get("use_sliding_window", True)  # Qwen2 declares it; Mistral has no flag
    n = cfg["num_hidden_layers"]
    if window and use_window:
        types = cfg.get("layer_types")
        if not types and architecture == GEMMA3:
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        elif not types and "max_window_layers" in cfg:  # Qwen2: the first layers attend fully
            types = [SLIDING if i >= cfg["max_window_layers"] else FULL for i in range(n)]
        elif not types:
            types = [SLIDING] * n
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"layer_types must list {SLIDING!r} or {FULL!r} for each of {n} layers")
        if SLIDING in types:
            fields.update(sliding_window=int(window), layer_types=list(types))
    if architecture == GEMMA3:
        rope = cfg.get("rope_parameters") or {}
        full = rope.get(FULL) or {}
        local = rope.get(SLIDING) or {}
        fields["rope_theta"] = float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
        fields["rope_scaling"] = ({k: v for k, v in full.items() if k != "rope_theta"}
                                  if full else cfg.get("rope_scaling"))
        fields["rope_local_theta"] = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
        fields["query_pre_attn_scalar"] = float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 3 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key):
            fields[key] = float(cfg[key])
    return fields


def gguf_pattern_fields(meta, architecture: str, num_layers: int) -> dict:
    """The same from GGUF metadata (`meta(key)` reads `<arch>.<key>`): the window in
    `attention.sliding_window`, which layers use it in `attention.sliding_window_pattern`
    (every n-th layer global, or one bool per layer: True for a window; Gemma 3's files often
    leave it out: llama.cpp's fixed 6), the local RoPE base in `rope.freq_base_swa`."""
    fields: dict = {}
    window = meta("attention.sliding_window")
    pattern = meta("attention.sliding_window_pattern")
    if architecture == GEMMA3:
        window = window or 512
        pattern = pattern or 6
        # llama.cpp scales queries by 1/sqrt(head_dim) (hidden/heads for the 27B only)
        fields.update(rope_local_theta=float(meta("rope.freq_base_swa", 10_000.0)),
                      query_pre_attn_scalar=float(meta("attention.key_length", 256)))
    if window:
        if pattern is None:
            types = [SLIDING] * num_layers
        elif isinstance(pattern, (list, tuple)):
            types = [SLIDING if p else FULL for p in pattern]
        else:
            types = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers)]
        fields.update(sliding_window=int(window), layer_types=types)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = meta(key)
        if value:
            fields[key] = float(value)
    return fields


def layer_windows(layer_types: list[str] | None, sliding_window: int | None,
                  num_layers: int) -> list[int | None]:
    """Each layer's window (None: it attends to the whole context)."""
    if not sliding_window or not layer_types:
        return [None] * num_layers
    return [sliding_window if t == SLIDING else None for t in layer_types]
