"""LoRA adapters as kvflow reads and schedules them: a PEFT folder is checked before anything
is loaded (rank, targets, shapes, files, unsupported features), slots are reused least recently
used first, a step holds at most max_loras adapters, and prefix-cache blocks are keyed by
adapter. No engine is started here (a tiny HF model and PEFT's own save_pretrained)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from core_helpers import FakeRunner, run_to_completion
from conftest_model_helpers import save_tiny_llama3
from kvflow.config import CacheConfig, LoRAConfig, SchedulerConfig
from kvflow.core.scheduler import Scheduler
from kvflow.lora_request import LoRARequest
from kvflow.model.arch import load_arch_config
from kvflow.model.lora import LoRASlots, load_adapter
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from lora_helpers import save_random_adapter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    base = str(tmp_path_factory.mktemp("tiny"))
    save_tiny_llama3(base)
    load = lambda: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # noqa: E731
    root = tmp_path_factory.mktemp("adapters")
    good = save_random_adapter(load(), str(root / "good"), seed=1, r=8, alpha=16)
    rank32 = save_random_adapter(load(), str(root / "rank32"), seed=2, r=32, alpha=32)
    rslora = save_random_adapter(load(), str(root / "rslora"), seed=3, r=4, alpha=8, rslora=True,
                                 targets=["q_proj", "v_proj"])
    return base, load_arch_config(base), root, good, rank32, rslora


def _copy(src: str, dst, **config_changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(config_changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dst)


def _load(path: str, arch, max_rank: int = 16):
    return load_adapter(LoRARequest("a", 1, path), arch, max_rank)


def test_a_peft_adapter_loads_with_its_scaling_folded_into_b(tiny):
    from safetensors.torch import load_file

    _, arch, _, good, _, rslora = tiny
    ad = _load(good, arch)
    assert ad.rank == 8 and ad.scaling == 2.0
    assert len(ad.weights) == 7 * arch.num_hidden_layers
    raw = load_file(os.path.join(good, "adapter_model.safetensors"))
    a, b = ad.weights[(1, "down_proj")]
    key = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(a, raw[f"{key}.lora_A.weight"])
    assert torch.equal(b, raw[f"{key}.lora_B.weight"] * 2.0)
    rs = _load(rslora, arch)  # rslora: alpha / sqrt(r)
    assert rs.scaling == 8 / 2 and set(m for _, m in rs.weights) == {"q_proj", "v_proj"}


@pytest.mark.parametrize("change,match", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "c_attn"]}, r"c_attn.*not modules of this model"),
    ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
    ({"r": 0}, "positive integer"),
])
def test_unsupported_or_bad_configs_are_refused(tiny, tmp_path, change, match):
    _, arch, _, good, _, _ = tiny
    with pytest.raises(ValueError, match=match):
        _load(_copy(good, tmp_path / "bad", **change), arch)


def test_a_rank_over_max_lora_rank_is_refused(tiny):
    _, arch, _, _, rank32, _ = tiny
    with pytest.raises(ValueError, match="rank 32 is over max_lora_rank 16"):
        _load(rank32, arch, 16)
    assert _load(rank32, arch, 32).rank == 32


def test_missing_files_are_refused(tiny, tmp_path):
    _, arch, _, good, _, _ = tiny
    with pytest.raises(ValueError, match="no such folder"):
        _load(str(tmp_path / "nowhere"), arch)
    no_config = _copy(good, tmp_path / "no_config")
    os.remove(os.path.join(no_config, "adapter_config.json"))
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        _load(no_config, arch)
    pickled = _copy(good, tmp_path / "pickled")
    os.rename(os.path.join(pickled, "adapter_model.safetensors"),
              os.path.join(pickled, "adapter_model.bin"))
    with pytest.raises(ValueError, match="pickle, which is never loaded"):
        _load(pickled, arch)
    broken = _copy(good, tmp_path / "broken")
    with open(os.path.join(broken, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        _load(broken, arch)


def test_an_adapter_of_another_model_is_refused(tiny, tmp_path):
    """Shapes are checked against this model: an adapter made for a wider model is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, arch, _, _, _, _ = tiny
    other = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320))
    path = save_random_adapter(other, str(tmp_path / "other"), seed=0)
    with pytest.raises(ValueError, match="has shape .* this model needs"):
        _load(path, arch)
    deep = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=320))
    path = save_random_adapter(deep, str(tmp_path / "deep"), seed=0, targets=["o_proj"])
    with pytest.raises(ValueError, match="the model has 3 layers"):
        _load(path, arch)


def test_non_finite_weights_are_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    _, arch, _, good, _, _ = tiny
    path = _copy(good, tmp_path / "nan")
    st = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(st)
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, st)
    with pytest.raises(ValueError, match="inf or NaN"):
        _load(path, arch)


def test_slots_are_reused_least_recently_used_first(tiny):
    from kvflow.model.loader import load_model

    base, arch, _, good, _, rslora = tiny
    model, _ = load_model(base, torch.float32)
    slots = LoRASlots(model, arch, max_loras=2, max_rank=16)
    adapters = {1: load_adapter(LoRARequest("a", 1, good), arch, 16),
                2: load_adapter(LoRARequest("b", 2, rslora), arch, 16),
                3: load_adapter(LoRARequest("c", 3, good), arch, 16)}
    assert slots.assign([1, 2], adapters) == {1: 0, 2: 1}
    assert slots.assign([2], adapters) == {2: 1}  # 1 is now the least recently used
    assert slots.assign([3], adapters) == {3: 0}  # evicts 1, not 2
    assert list(slots.resident) == [2, 3]
    qkv = model.layers[0].lora_slots["qkv"]
    assert int(qkv.ranks[0]) == 8 and int(qkv.ranks[1]) == 4
    assert int(model.layers[0].lora_slots["down"].ranks[1]) == 0  # "b" targets only q and v
    a, b = adapters[3].weights[(0, "k_proj")]
    kv = arch.num_key_value_heads * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    assert torch.equal(qkv.a[0, 16:24], a) and torch.equal(qkv.bt[0, :8, q:q + kv], b.T)


def test_trim_drops_the_least_recently_used_idle_adapters(tiny):
    """max_cpu_loras: past the cap, the least recently used adapter without unfinished
    requests leaves host memory (and its slot); a busy one stays, even over the cap."""
    from kvflow.model.loader import load_model
    from kvflow.model.lora import LoRAManager

    base, arch, _, good, _, rslora = tiny
    model, _ = load_model(base, torch.float32)
    lora = LoRAManager(model, arch, max_loras=1, max_lora_rank=16)
    for i, path in enumerate((good, rslora, good), 1):
        lora.add(LoRARequest(f"a{i}", i, path))
    lora.step([2], np.array([1]))  # 2 in the slot: now the most recently used
    assert lora.trim(2, busy={1}) == [3]  # 1 is the least recently used, but busy
    assert list(lora.adapters) == [1, 2] and list(lora.slots.resident) == [2]
    assert lora.trim(1, busy={1, 2}) == [] and len(lora.adapters) == 2
    assert lora.trim(1, busy=set()) == [1]
    assert lora.trim(0, busy=set()) == [2] and not lora.slots.resident


def test_lora_config_is_checked():
    with pytest.raises(ValueError, match="max_cpu_loras .* must be at least max_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="power of two"):
        LoRAConfig(enable_lora=True, max_lora_rank=12)
    with pytest.raises(ValueError, match="needs enable_lora"):
        LoRAConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="not name=path"):
        LoRAConfig(enable_lora=True, lora_modules=["just-a-path"])
    assert LoRAConfig(enable_lora=True, lora_modules=["sql = /a/b"]).modules() == [("sql", "/a/b")]
    with pytest.raises(ValueError, match="given twice"):
        LoRAConfig(enable_lora=True, lora_modules=["a=/x", "a=/y"])
    from kvflow.entrypoints.openai.server_settings import ServerSettings
    with pytest.raises(ValueError, match="the base model's served name"):
        ServerSettings(served_model_names=["m"], lora_modules=[("m", "/x")])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


# -- the scheduler and the prefix cache (no model) -----------------------------------------
def _req(rid: str, lora: int | None, prompt: list[int] | None = None) -> Request:
    lr = LoRARequest(f"a{lora}", lora, f"/adapters/{lora}") if lora else None
    return Request(rid, prompt or list(range(1, 40)), SamplingParams(max_tokens=3), lora_request=lr)


def _sched(max_loras: int) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=256),
                  CacheConfig(block_size=4, num_blocks=256))
    s.max_loras = max_loras
    return s


def test_a_step_runs_at_most_max_loras_adapters_and_the_base_model_beside_them():
    sched = _sched(max_loras=2)
    lora_of = {"b0": 0, "x1": 1, "y2": 2, "z3": 3, "x1b": 1, "b1": 0}
    for rid, lora in lora_of.items():
        sched.add_request(_req(rid, lora))
    out = sched.schedule()
    ran = set(out.num_scheduled_tokens)
    assert ran == {"b0", "x1", "y2", "x1b", "b1"}  # adapter 3 waits; the rest of the queue goes on
    assert out.waiting_for_lora_ids == ["z3"]
    new = {n.req_id: n.lora_int_id for n in out.scheduled_new_reqs}
    assert new == {"b0": 0, "x1": 1, "y2": 2, "x1b": 1, "b1": 0}
    runner = FakeRunner()
    sched.update_from_output(out, runner.execute(out))
    seen: list[set[int]] = []
    run_to_completion(sched, runner, on_step=lambda o, *_: seen.append(
        {lora_of[r] for r in o.num_scheduled_tokens} - {0}))
    assert not sched.has_unfinished_requests()
    assert all(len(s) <= 2 for s in seen) and any(3 in s for s in seen)


def test_prefix_cache_blocks_are_never_shared_across_adapters():
    prompt = list(range(100, 140))  # ten full blocks of 4
    sched = _sched(max_loras=4)
    runner = FakeRunner()
    sched.add_request(_req("first", 1, prompt))
    run_to_completion(sched, runner)
    for rid, lora in [("same", 1), ("other", 2), ("base", None)]:
        sched.add_request(_req(rid, lora, prompt))
    out = sched.schedule()
    assert out.num_cached_tokens == {"same": 36, "other": 0, "base": 0}


def test_a_cache_salt_cannot_pose_as_an_adapter():
    a = _req("a", 1)
    forged = Request("f", list(range(1, 40)), SamplingParams(max_tokens=3),
                     cache_salt=(a.cache_salt or "") + "\xff\x01")
    assert a.salt_bytes != forged.salt_bytes and a.block_salt != forged.block_salt
    assert (a.lora_int_id, forged.lora_int_id) == (1, 0)
