"""What the hybrid families' modules share (LFM2, Qwen3.5 / Qwen3-Next, Granite 4.0-H): the
Llama module over layers of two kinds, attention layers and layers that keep a state per
request. A state layer holds its mixer in the attribute `state_attr` (kvflow/layers/: a module
with `allocate_state(num_slots, dtype)`, `copy_states(pairs)`, `in_proj` and `out_proj`); an
attention layer's projections are `attention_projections`. Not a family: no registry line."""
from __future__ import annotations

from kvflow.models.llama import LlamaForCausalLM


class HybridForCausalLM(LlamaForCausalLM):
    state_attr = "state"
    attention_projections = ("qkv_proj", "o_proj")

    def state_modules(self) -> list:
        return [getattr(layer, self.state_attr) for layer in self.layers if hasattr(layer, self.state_attr)]

    def allocate_state(self, num_slots: int) -> None:
        """Give the state layers `num_slots` slots each (running requests' and snapshots)."""
        for m in self.state_modules():
            m.allocate_state(num_slots, self.dtype)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot a into slot b, for each (a, b), in every state layer."""
        for m in self.state_modules():
            m.copy_states(pairs)

    def pack_weights(self) -> bool:
        pack = self.kernels.pack
        if self.embed_tokens.device.type != "cpu" or pack is None:
            return False
        for layer in self.layers:
            state = getattr(layer, self.state_attr, None)
            owner, names = ((state, ("in_proj", "out_proj")) if state is not None
                            else (layer, self.attention_projections))
            layer.packed = {name: pack(getattr(owner, name)) for name in names}
            if layer.moe is not None:
                layer.moe.pack_weights(pack)
                continue
            layer.packed["gate_up_proj"] = pack(layer.gate_up_proj, gate_up=True)
            layer.packed["down_proj"] = pack(layer.down_proj)
        self.packed_lm_head = pack(self.embed_tokens if self.lm_head is None else self.lm_head)
        return True
