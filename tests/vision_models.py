"""A tiny random Gemma 3 vision-language model (Gemma3ForConditionalGeneration: a SigLIP tower,
the pooling projector, the Gemma 3 text decoder with local and global layers) saved as an HF
folder with a byte-level tokenizer that knows Gemma's image tokens and the image processor's
config, and the HF reference that the equivalence tests compare with."""
from __future__ import annotations

import torch

from conftest_model_helpers import save_byte_tokenizer

VOCAB = 320
SPECIALS = ("<unk>", "<s>", "</s>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
            "<image_soft_token>")
BOI, EOI, IMAGE = 4, 5, 6  # their ids in the tokenizer above
MM_TOKENS = 4  # image tokens per image: 4 x 4 patches pooled 2 x 2
IMAGE_SIZE = 32


def save_tiny_gemma3_vision(path: str, seed: int = 0, sliding_window: int = 8) -> str:
    """4 text layers alternating a window of `sliding_window` with full attention; a 2-layer
    SigLIP over 32 x 32 images in 8 x 8 patches."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, sliding_window=sliding_window,
                sliding_window_pattern=2, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                query_pre_attn_scalar=24, final_logit_softcapping=30.0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8,
                  vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=MM_TOKENS,
                          boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
                          bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0,
                          tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # norms at one, biases and the projection at zero: perturb them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mm_input_projection_weight"):
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    save_byte_tokenizer(path, VOCAB, SPECIALS)
    Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    return path


def hf_pixel_values(path: str, images) -> torch.Tensor:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")["pixel_values"]


def hf_model(path: str):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, model, token_ids: list[int], images, max_tokens: int) -> list[int]:
    """HF's greedy tokens (fp32) for expanded `token_ids` with `images` in order: the image
    tokens marked in token_type_ids, as Gemma3Processor marks them (their bidirectional mask);
    one whole forward per token, end-of-sequence tokens included (as ignore_eos samples)."""
    pixels = hf_pixel_values(path, images) if images else None
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            t = torch.tensor([ids])
            kwargs = dict(pixel_values=pixels, token_type_ids=(t == IMAGE).long()) if images else {}
            logits = model(input_ids=t, attention_mask=torch.ones_like(t), **kwargs).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(token_ids):]
