"""Tiny random Hugging Face models saved as ordinary HF folders, plus a step-by-step driver
that feeds kvflow's model a schedule of chunks over a shuffled paged cache."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.kv_cache import allocate_kv_caches

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=512)


def save_tiny_llama3(path: str, seed: int = 0) -> str:
    """Llama-3-shaped: llama3 RoPE scaling, GQA 4/2 heads, untied lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **TINY, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=[2, 3])
    return _save_random(LlamaForCausalLM, config, path, seed)


def save_tiny_qwen2(path: str, seed: int = 0) -> str:
    """Qwen2-shaped: q/k/v biases, GQA 4/2 heads, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1000000.0,
                         bos_token_id=1, eos_token_id=2)
    return _save_random(Qwen2ForCausalLM, config, path, seed)


def _save_random(cls, config, path: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # default init leaves biases at zero and norms at one: perturb them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Reference logits [len, vocab] of one unpadded sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


class PagedDriver:
    """Feeds kvflow's model one flat batch per step, like the runner does.

    Each sequence's blocks come from a shuffled pool on demand, so block tables are
    non-contiguous and interleaved across sequences. A model with state layers gets a state
    slot per sequence (from the top down, so that no slot is its sequence's place in a batch).
    A model with sliding-window layers gets one metadata per layer, each carrying its layer's
    window (the blocks stay whole: the window masks, it frees nothing)."""

    def __init__(self, model, arch, num_blocks: int = 64, block_size: int = 4, seed: int = 0,
                 num_state_slots: int = 8):
        self.model, self.block_size = model, block_size
        windows = arch.kv_layer_windows()
        self.windows = windows if any(windows) else None
        self.kv_caches = allocate_kv_caches(arch, num_blocks, block_size, model.dtype)
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.stateful = hasattr(model, "allocate_state")
        if self.stateful:
            model.allocate_state(num_state_slots)
        self.free_slots = list(range(num_state_slots))
        self.slots: dict[str, int] = {}

    def step(self, plan: list[tuple[str, list[int]]],
             saves: dict[str, tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
        """plan: (sequence id, this step's new tokens) in batch order -> logits per sequence.
        `saves` (state models): sequence id -> (the offset in its tokens of the one after which
        its state is kept, the snapshot slot it goes to)."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for sid, tokens in plan:
            start = self.computed.get(sid, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(int(self.free.pop()))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            ids += tokens
            positions += range(start, end)
            self.computed[sid] = end
        meta = build_attention_metadata(np.array(query_lens), np.array(seq_lens), tables, self.block_size)
        if self.stateful:
            for sid, _ in plan:
                if sid not in self.slots:
                    self.slots[sid] = self.free_slots.pop()
            meta.state_slots = np.array([self.slots[sid] for sid, _ in plan])
            row = {sid: i for i, (sid, _) in enumerate(plan)}
            meta.state_saves = {row[sid]: save for sid, save in (saves or {}).items()}
        assert meta.positions.tolist() == positions
        if self.windows is not None:
            metas = {w: build_attention_metadata(np.array(query_lens), np.array(seq_lens), tables,
                                                 self.block_size, sliding_window=w) for w in set(self.windows)}
            meta = [metas[w] for w in self.windows]
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        out, offset = {}, 0
        for sid, tokens in plan:
            out[sid] = logits[offset: offset + len(tokens)]
            offset += len(tokens)
        return out


def save_byte_tokenizer(path: str, vocab_size: int = TINY["vocab_size"],
                        specials: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<|eot_id|>",
                                                     "<|eom_id|>")) -> str:
    """A byte-level tokenizer whose ids all fit a tiny model's vocabulary: the special tokens
    first (ids 0..), then the 256 bytes, then filler tokens up to `vocab_size`, so that every
    id a random model can sample decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    assert len(vocab) == vocab_size, f"{len(vocab)} tokens do not fit a vocabulary of {vocab_size}"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=list(specials[3:]))
    fast.save_pretrained(path)
    return path
