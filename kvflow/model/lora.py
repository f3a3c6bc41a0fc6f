"""LoRA adapters served beside the base model (docs/lora.md): a PEFT adapter folder read and
checked (`load_adapter`), the model's fixed set of adapter slots (`LoRASlots`: one set of
stacked A / B tensors per projection and layer, `max_loras` deep, `max_lora_rank` wide), and the
runner's `LoRAManager`, which keeps the registered adapters and maps each step's rows to slots.

In a step the rows of every adapter and of the base model run in one batch: each projection is
the base GEMM (quantized or float) followed by the batched shrink and expand of kernels.lora
(Punica's BGMV: y[t] += B[slot[t]] A[slot[t]] x[t]), rows of the base model skipped. The
adapter's scaling (lora_alpha / r, or / sqrt(r) with rslora) is folded into B at load, as vLLM
does. Fused projections (q|k|v, gate|up) take their slices' adapters as one shrink of stacked
A's and one expand whose outputs know their slice."""
from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.lora_request import LoRARequest
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.lora_shard import lora_shard_of, shard_adapter
from kvflow.models.registry import family_of

# PEFT module names -> the fused projection of kvflow's decoder layer and its slice there
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                     "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
SLICE_OF = {m: (fused, j) for fused, mods in FUSED.items() for j, m in enumerate(mods)}
_MLP = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")
# adapter_config.json keys whose set value (bias: other than "none") is a PEFT feature not
# served here: refused, never ignored
_UNSUPPORTED = ("use_dora", "fan_in_fan_out", "bias", "modules_to_save", "rank_pattern",
                "alpha_pattern", "lora_bias", "use_qalora", "target_parameters",
                "trainable_token_indices", "megatron_config", "layer_replication")
MAX_CONFIG_BYTES = 1 << 20


@dataclass
class LoRAAdapter:
    """One adapter, read and checked, on the host: per (layer, PEFT module) its A [r, in] and
    its B [out, r] times the scaling, fp32."""

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def module_shapes(arch: LlamaArchConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT target module of this architecture."""
    h, d, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _targets(config: dict) -> set[str] | re.Pattern:
    t = config.get("target_modules")
    if t == "all-linear":
        return set(TARGET_MODULES)
    if isinstance(t, str):
        return re.compile(t)
    if not isinstance(t, list) or not t or not all(isinstance(m, str) for m in t):
        raise ValueError("adapter_config.json: target_modules must be a non-empty list of module "
                         "names, a regex or \"all-linear\"")
    unknown = sorted(set(t) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"adapter_config.json: target_modules {unknown} are not modules of this "
                         f"model (LoRA applies to {', '.join(TARGET_MODULES)})")
    return set(t)


def read_adapter_config(path: str, max_lora_rank: int) -> tuple[dict, int, float]:
    """(the config, r, scaling) of a PEFT LoRA folder; ValueError naming what is wrong."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: no such folder")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is missing")
    if os.path.getsize(cfg_path) > MAX_CONFIG_BYTES:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is over 1 MiB")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not an object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not supported (LORA only)")
    for key in _UNSUPPORTED:
        value = config.get(key)
        if value is not None and (value != "none" if key == "bias" else bool(value)):
            raise ValueError(f"LoRA adapter {path!r}: {key}={value!r} is not supported "
                             f"(plain LoRA on {', '.join(TARGET_MODULES)} only)")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"LoRA adapter {path!r}: r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r}: rank {r} is over max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return config, r, float(scaling)


def load_adapter(request: LoRARequest, arch: LlamaArchConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter for `arch` (ValueError naming the problem; nothing is kept
    on failure): rank within `max_lora_rank`, targets among the model's projections, every A/B
    present with this model's shapes, safetensors only (never pickle)."""
    from safetensors import safe_open

    path = request.lora_path
    config, r, scaling = read_adapter_config(path, max_lora_rank)
    targets = _targets(config)
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st_path):
        bin_note = (" (adapter_model.bin is a pickle, which is never loaded: save with "
                    "safe_serialization=True)" if os.path.isfile(os.path.join(path, "adapter_model.bin")) else "")
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.safetensors is missing{bin_note}")
    shapes = module_shapes(arch)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(st_path, framework="pt") as f:
            for key in f.keys():
                m = _KEY.fullmatch(key)
                if m is None:
                    raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA A/B of "
                                     f"{', '.join(TARGET_MODULES)} (unsupported PEFT feature?)")
                layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
                if module not in shapes or (block == "mlp") != (module in _MLP):
                    raise ValueError(f"LoRA adapter {path!r}: {key!r}: {block}.{module} is not a "
                                     f"projection of this model")
                if layer >= arch.num_hidden_layers:
                    raise ValueError(f"LoRA adapter {path!r}: {key!r}: the model has "
                                     f"{arch.num_hidden_layers} layers")
                if module in _MLP and arch.is_moe_layer(layer):
                    raise ValueError(f"LoRA adapter {path!r}: layer {layer}'s MLP is a mixture of "
                                     f"experts: LoRA on its {module} is not supported")
                in_f, out_f = shapes[module]
                t = f.get_tensor(key)
                want = (r, in_f) if ab == "A" else (out_f, r)
                if tuple(t.shape) != want:
                    raise ValueError(f"LoRA adapter {path!r}: {key!r} has shape {tuple(t.shape)}, "
                                     f"this model needs {want}")
                if not t.is_floating_point():
                    raise ValueError(f"LoRA adapter {path!r}: {key!r} is {t.dtype}, not a float")
                parts.setdefault((layer, module), {})[ab] = t.float()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file is the client's problem, told as such
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.safetensors unreadable ({e})") from None
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} lacks lora_"
                             f"{'B' if 'A' in ab else 'A'}")
        # a regex (PEFT matches it against full module paths) says nothing simpler to check
        if isinstance(targets, set) and module not in targets:
            raise ValueError(f"LoRA adapter {path!r}: weights for {module}, which target_modules "
                             f"does not name")
        if not (torch.isfinite(ab["A"]).all() and torch.isfinite(ab["B"]).all()):
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has inf or NaN weights")
        weights[(layer, module)] = (ab["A"].contiguous(), (ab["B"] * scaling).contiguous())
    if not weights:
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(request.lora_name, request.lora_int_id, path, r, scaling, weights)


def lora_device(model) -> torch.device:
    """Where the model computes (a quantized model's float embedding may be on `meta`)."""
    return model.rope_cos.device


@dataclass
class LoRAProjection:
    """One projection's slots (lora.c's layouts): a [S, n_slices * R, K], bt [S, R, N] (fp32),
    ranks [S] (0: that slot's adapter leaves this projection alone), starts [n_slices + 1]."""

    a: torch.Tensor
    bt: torch.Tensor
    ranks: torch.Tensor
    starts: torch.Tensor
    bounds: list[int] = field(default_factory=list)  # starts, as ints


@dataclass
class LoRAStep:
    """A step's adapter rows: slots[t] is token t's slot, -1 for the base model's rows."""

    slots: torch.Tensor


class LoRASlots:
    """`max_loras` slots of `max_rank` in every projection of every layer, and which adapter
    sits in each: assigned per step, an idle adapter's slot reused least recently used first."""

    def __init__(self, model, arch: LlamaArchConfig, max_loras: int, max_rank: int,
                 first_layer: int = 0) -> None:
        # `arch`: the shapes of this rank's shard (its heads, MLP rows and stage's layers)
        shapes = module_shapes(arch)
        device = lora_device(model)
        self.max_loras, self.max_rank, self.arch = max_loras, max_rank, arch
        self.layers: list[dict[str, LoRAProjection]] = []
        for i, layer in enumerate(model.layers):
            projs = {}
            for fused, mods in FUSED.items():
                if fused in ("gate_up", "down") and arch.is_moe_layer(first_layer + i):
                    continue
                k = shapes[mods[0]][0]
                bounds = [0]
                for m in mods:
                    bounds.append(bounds[-1] + shapes[m][1])
                projs[fused] = LoRAProjection(
                    torch.zeros(max_loras, len(mods) * max_rank, k, device=device),
                    torch.zeros(max_loras, max_rank, bounds[-1], device=device),
                    torch.zeros(max_loras, dtype=torch.int64, device=device),
                    torch.tensor(bounds, dtype=torch.int64, device=device), bounds)
            layer.lora_slots = projs
            self.layers.append(projs)
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * 4 + p.bt.numel() * 4 for layer in self.layers for p in layer.values())

    def assign(self, ids: list[int], adapters: dict[int, LoRAAdapter]) -> dict[int, int]:
        """Slots for this step's adapters (at most max_loras: the scheduler keeps to that),
        writing the ones not resident over free or least recently used idle slots."""
        wanted = list(dict.fromkeys(ids))
        assert len(wanted) <= self.max_loras, f"{len(wanted)} adapters in one step, {self.max_loras} slots"
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        for lid in wanted:
            if lid in self.resident:
                continue
            if free:
                slot = free.pop(0)
            else:  # evict the least recently used adapter this step does not run
                victim = next(v for v in self.resident if v not in wanted)
                slot = self.resident.pop(victim)
            self._write(slot, adapters[lid])
            self.resident[lid] = slot
        for lid in wanted:
            self.resident.move_to_end(lid)
        return {lid: self.resident[lid] for lid in wanted}

    def evict(self, lora_id: int) -> None:
        """Forget an adapter's slot (it was unloaded)."""
        self.resident.pop(lora_id, None)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r, rmax = adapter.rank, self.max_rank
        for i, projs in enumerate(self.layers):
            for fused, p in projs.items():
                p.a[slot].zero_()
                p.bt[slot].zero_()
                hit = False
                for j, module in enumerate(FUSED[fused]):
                    w = adapter.weights.get((i, module))
                    if w is None:
                        continue
                    a, b = w
                    hit = True
                    p.a[slot, j * rmax:j * rmax + r].copy_(a)
                    p.bt[slot, :r, p.bounds[j]:p.bounds[j + 1]].copy_(b.T)
                p.ranks[slot] = r if hit else 0


class LoRAManager:
    """The registered adapters of one model (read and checked once, kept on the host) and its
    slots; `step` maps a step's requests to slots. Under tensor or pipeline parallelism the
    model is a rank's shard (`first_layer`: its stage's first layer) and each adapter is kept
    cut to it (model/lora_shard.py)."""

    def __init__(self, model, arch: LlamaArchConfig, max_loras: int, max_lora_rank: int,
                 first_layer: int = 0) -> None:
        family = family_of(arch.architecture)
        family.supports.check(family.name, lora=True)
        self.max_lora_rank = max_lora_rank
        self.shard = lora_shard_of(model, first_layer)
        # adapters are checked against the whole model, on every rank
        self.arch = arch if self.shard is None else model.arch
        # registered adapters, least recently used first (a step's adapters move to the end)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slots = LoRASlots(model, arch, max_loras, max_lora_rank, first_layer)
        self.device = lora_device(model)

    def add(self, request: LoRARequest) -> bool:
        """Register an adapter (False: that id is registered already with this path);
        ValueError if it cannot be served here, and nothing is registered then."""
        old = self.adapters.get(request.lora_int_id)
        if old is not None:
            if os.path.abspath(old.path) != os.path.abspath(request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is {old.name!r} at "
                                 f"{old.path!r} already")
            return False
        adapter = load_adapter(request, self.arch, self.max_lora_rank)
        if self.shard is not None:
            adapter = shard_adapter(adapter, self.shard, self.arch.head_dim)
        self.adapters[request.lora_int_id] = adapter
        return True

    def trim(self, max_adapters: int, busy: set[int]) -> list[int]:
        """Drop least recently used adapters not in `busy` until at most `max_adapters` are
        registered (fewer drops where the rest are busy); the ids dropped."""
        dropped = []
        for lid in list(self.adapters):
            if len(self.adapters) <= max_adapters:
                break
            if lid not in busy:
                self.remove(lid)
                dropped.append(lid)
        return dropped

    def remove(self, lora_id: int) -> bool:
        self.slots.evict(lora_id)
        return self.adapters.pop(lora_id, None) is not None

    def step(self, lora_ids: list[int], query_lens: np.ndarray) -> LoRAStep | None:
        """The step's LoRAStep (None: every row is the base model's, nothing to add)."""
        if not any(lora_ids):
            return None
        slot_of = self.slots.assign([i for i in lora_ids if i], self.adapters)
        for i in slot_of:
            self.adapters.move_to_end(i)
        per_req = np.fromiter((slot_of[i] if i else -1 for i in lora_ids), dtype=np.int64,
                              count=len(lora_ids))
        slots = torch.from_numpy(np.repeat(per_req, query_lens))
        return LoRAStep(slots.to(self.device) if self.device.type != "cpu" else slots)
