"""Many sequences at once through llama.cpp's low-level batch API (llama-cpp-python), greedy.

Prompts are packed into `n_batch`-token decode calls (logits only at each prompt's last
token); then every live sequence decodes one token per call, all in one batch. Each sequence
has its own KV stream of n_ctx / n_seq_max cells (`kv_unified=False`: with one unified cache
every token would attend over all sequences' cells under a mask, which is quadratic in the
batch); llama.cpp's default KV type (f16) and attention."""
from __future__ import annotations

import ctypes

import llama_cpp as lc
import numpy as np

GGML_TYPE_NAMES = {0: "f32", 1: "f16", 30: "bf16"}


class LlamaCppBatch:
    def __init__(self, gguf_path: str, n_threads: int, n_seq_max: int, n_ctx: int,
                 n_batch: int = 2048) -> None:
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.kv_type = GGML_TYPE_NAMES.get(cparams.type_k, str(cparams.type_k))
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self.batch = lc.llama_batch_init(max(n_batch, n_seq_max), 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """entries: (token, position, sequence, wants logits) -> argmax of each wanted row."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")
        n_out = sum(1 for e in entries if e[3])
        ptr = lc.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                       shape=(n_out, self.vocab_size))
        return logits.argmax(axis=1)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy, EOS ignored: exactly max_tokens new tokens per prompt."""
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        outs: list[list[int]] = [[] for _ in prompts]
        # prefill: pack prompt tokens into n_batch-sized calls
        pending: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []
        for s, p in enumerate(prompts):
            for j, tok in enumerate(p):
                last = j == len(p) - 1
                pending.append((tok, j, s, last))
                if last:
                    owners.append(s)
                if len(pending) == self.n_batch:
                    self._flush(pending, owners, outs)
        self._flush(pending, owners, outs)
        # decode: every sequence one token per call
        live = [s for s in range(len(prompts)) if len(outs[s]) < max_tokens]
        while live:
            entries = [(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True) for s in live]
            for s, tok in zip(live, self._decode(entries).tolist()):
                outs[s].append(tok)
            live = [s for s in live if len(outs[s]) < max_tokens]
        return outs

    def _flush(self, pending, owners, outs) -> None:
        if pending:
            for s, tok in zip(owners, self._decode(pending).tolist()):
                outs[s].append(tok)
        pending.clear()
        owners.clear()
