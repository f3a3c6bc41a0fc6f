"""A tiny random Qwen3-VL (Qwen3VLForConditionalGeneration: its ViT with 2D RoPE, learned
position embeddings resampled to each image's grid, the 2x2 patch merger and two DeepStack
mergers; the Qwen3 text decoder with interleaved M-RoPE) saved as an HF folder with a byte-level
tokenizer that knows its vision tokens and the image processor's config, and HF's reference."""
from __future__ import annotations

import torch

from conftest_model_helpers import save_byte_tokenizer

VOCAB = 320
SPECIALS = ("<unk>", "<s>", "</s>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>")
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 4, 5, 6, 7
PATCH, MERGE = 8, 2


def save_tiny_qwen3_vl(path: str, seed: int = 0) -> str:
    """3 text layers (head_dim 16: M-RoPE sections 2/3/3 of its 8 frequencies); a 3-block ViT
    over 8 x 8 patches (two frames each), DeepStack features from blocks 0 and 1; images resized
    to multiples of 16 pixels between 32 x 32 and 64 x 64."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                  temporal_patch_size=2, spatial_merge_size=MERGE, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                           video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # norms at one, biases at zero: perturb them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    save_byte_tokenizer(path, VOCAB, SPECIALS)
    Qwen2VLImageProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64}, patch_size=PATCH,
                          temporal_patch_size=2, merge_size=MERGE).save_pretrained(path)
    return path


def hf_model(path: str):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, model, token_ids: list[int], images, max_tokens: int) -> list[int]:
    """HF's greedy tokens (fp32) for expanded `token_ids` with `images` in order (their image
    pad tokens marked in mm_token_type_ids): one whole forward per token."""
    from transformers import AutoImageProcessor

    kwargs = {}
    if images:
        px = AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
        kwargs = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            t = torch.tensor([ids])
            extra = dict(kwargs, mm_token_type_ids=(t == IMAGE_PAD).int()) if images else {}
            logits = model(input_ids=t, attention_mask=torch.ones_like(t), **extra).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(token_ids):]
