"""Which layers attend through a sliding window, and the logit soft-capping that goes with
them (Gemma 3's interleaved local/global layers, Mistral's `sliding_window`, Qwen2's
`use_sliding_window` / `max_window_layers`), read from an HF config or GGUF metadata; a
family's own RoPE constants come from its file in kvflow/models/.

No torch here: the arch config (and through it the scheduler's KV cache groups) reads it."""
from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"


def hf_pattern_fields(cfg: dict, default_pattern: int | None = None) -> dict:
    """LlamaArchConfig fields for windows and soft-capping from an HF config (empty for a model
    with none of them); `default_pattern`: the family's every-n-th-layer-global where the config
    lists no layer types (Gemma 3's 6)."""
    fields: dict = {}
    window = cfg.get("sliding_window")
    use_window = cfg.get("use_sliding_window", True)  # Qwen2 declares it; Mistral has no flag
    n = cfg["num_hidden_layers"]
    if window and use_window:
        types = cfg.get("layer_types")
        if not types and default_pattern:
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default_pattern
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        elif not types and "max_window_layers" in cfg:  # Qwen2: the first layers attend fully
            types = [SLIDING if i >= cfg["max_window_layers"] else FULL for i in range(n)]
        elif not types:
            types = [SLIDING] * n
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"layer_types must list {SLIDING!r} or {FULL!r} for each of {n} layers")
        if SLIDING in types:
            fields.update(sliding_window=int(window), layer_types=list(types))
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key):
            fields[key] = float(cfg[key])
    return fields


def gguf_pattern_fields(meta, num_layers: int, default_window: int | None = None,
                        default_pattern: int | None = None) -> dict:
    """The same from GGUF metadata (`meta(key)` reads `<arch>.<key>`): the window in
    `attention.sliding_window`, which layers use it in `attention.sliding_window_pattern`
    (every n-th layer global, or one bool per layer: True for a window). A family's defaults
    stand in where its files leave them out (Gemma 3's: llama.cpp's fixed 512 and 6)."""
    fields: dict = {}
    window = meta("attention.sliding_window") or default_window
    pattern = meta("attention.sliding_window_pattern") or default_pattern
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
