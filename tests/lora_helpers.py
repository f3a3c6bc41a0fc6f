"""Random PEFT LoRA adapters for tests, and Hugging Face's reference for them: the adapter
merged into the base model (`merge_and_unload`), greedy."""
from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base, path: str, seed: int, r: int = 8, alpha: float = 16,
                        targets: list[str] | None = None, rslora: bool = False,
                        b_scale: float = 0.05) -> str:
    """A PEFT LoRA adapter of `base` (an HF model, left unchanged) with random A and B (PEFT
    starts B at zero, which would change nothing), saved as adapter_config.json +
    adapter_model.safetensors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                        lora_dropout=0.0, use_rslora=rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * b_scale)
    peft_model.save_pretrained(path)
    peft_model.unload()  # the base model's modules back as they were
    return path


def merged_greedy(base, adapter_path: str | None, prompts: list[list[int]],
                  max_new_tokens: int) -> list[tuple[list[int], list[list[int]]]]:
    """HF's greedy tokens and top-3 ids per position (tests/conftest.py's reference shape) for
    a copy of the fp32 model `base` with the adapter merged in (None: the base alone)."""
    import copy

    from peft import PeftModel

    model = copy.deepcopy(base)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).merge_and_unload()
    model.eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, output_scores=True, return_dict_in_generate=True)
            tokens = gen.sequences[0, len(ids):].tolist()
            out.append((tokens, [s[0].topk(3).indices.tolist() for s in gen.scores]))
    del model
    return out


def write_adapter(path: str, model_path: str, seed: int, r: int = 8, alpha: float = 16,
                  targets: list[str] | None = None, b_scale: float = 0.05, **config) -> str:
    """A PEFT-format LoRA adapter for the model at `model_path` written directly (the keys and
    config PEFT's save_pretrained writes), without building the model in transformers: for
    tests that only serve it. `config` adds or overrides adapter_config.json keys."""
    import json
    import os

    from safetensors.torch import save_file

    from kvflow.model.arch import load_arch_config
    from kvflow.model.lora import module_shapes

    arch = load_arch_config(model_path)
    shapes = module_shapes(arch)
    g = torch.Generator().manual_seed(seed)
    targets = targets or ALL_TARGETS
    tensors = {}
    for i in range(arch.num_hidden_layers):
        for m in targets:
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{block}.{m}"
            k, n = shapes[m]
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, k, generator=g) / k ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, r, generator=g) * b_scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
                   "bias": "none", "use_dora": False, "use_rslora": False,
                   "task_type": "CAUSAL_LM", **config}, f)
    return path
