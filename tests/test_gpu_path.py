"""The GPU path's device-independent parts, on CPU: the CUDA-graph ladder and its persistent
buffers (capture off), the kernel choice for cuda, and the whole runner with the GPU kernel set
through Triton's interpreter against the CPU kernels (in a fresh process: the interpreter must
be on before triton is first imported)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.cuda_graphs import DecodeGraphs, capture_sizes
from kvflow.model.gpu_batch import MAX_SPLITS, device_metadata, num_decode_splits

HERE = Path(__file__).resolve().parent


def test_capture_sizes_follow_vllms_ladder_and_end_at_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128)[-3:] == [112, 120, 128]
    assert capture_sizes(4096)[-1] == 512  # bigger decode batches run eagerly


def _graphs(max_blocks=8):
    return DecodeGraphs([1, 2, 4, 8], max_blocks=max_blocks, num_heads=4, head_dim=8,
                        num_splits=2, device="cpu", capture=False)


def test_a_decode_batch_pads_to_the_next_captured_size():
    g = _graphs()
    assert [g.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert g.fits(3, 8) and not g.fits(3, 9) and not g.fits(9, 1)


def test_prepare_writes_the_step_into_persistent_buffers_with_inert_padding():
    g = _graphs()
    tables = [[5, 2], [7], [1, 3, 6]]
    meta = build_attention_metadata(np.ones(3), np.array([6, 3, 9]), tables, block_size=4)
    ids_before = g.input_ids.data_ptr()
    size, padded = g.prepare(meta, [11, 12, 13])
    assert size == 4 and padded.num_tokens == 4
    assert g.input_ids.data_ptr() == ids_before  # the same storage every step (what a graph reads)
    assert padded.slot_mapping.data_ptr() == g.slot_mapping.data_ptr()
    assert padded.device_positions.tolist() == [5, 2, 8, 0]
    assert g.input_ids[:4].tolist() == [11, 12, 13, 0]
    # the new tokens' slots; the padding row writes nowhere and reads nothing
    assert padded.slot_mapping.tolist() == [2 * 4 + 1, 7 * 4 + 2, 6 * 4 + 0, -1]
    assert padded.gpu.seq_lens.tolist() == [6, 3, 9, 0]
    assert padded.gpu.block_tables[:3, :3].tolist() == [[5, 2, 0], [7, 0, 0], [1, 3, 6]]
    assert padded.gpu.decode_only and padded.gpu.num_splits == 2
    assert padded.gpu.workspace[0].shape == (8 * 4 * 2, 8)
    # a smaller step afterwards re-pads: stale rows from the bigger one are cleared
    size, padded = g.prepare(build_attention_metadata(np.ones(1), np.array([2]), [[4]], 4), [9])
    assert size == 1 and g.slot_mapping[:1].tolist() == [17]
    size, padded = g.prepare(build_attention_metadata(np.ones(2), np.array([2, 1]), [[4], [0]], 4), [9, 8])
    assert size == 2 and padded.gpu.seq_lens.tolist() == [2, 1]


def test_run_with_capture_off_calls_the_forward_on_the_padded_buffers():
    g = _graphs()
    meta = build_attention_metadata(np.ones(3), np.array([1, 1, 1]), [[0], [1], [2]], 4)
    size, padded = g.prepare(meta, [3, 4, 5])
    seen = []
    out = g.run(size, padded, lambda ids, m: seen.append((ids.tolist(), m.num_tokens)) or ids * 2)
    assert seen == [([3, 4, 5, 0], 4)] and out.tolist() == [6, 8, 10, 0]
    assert g.eager_steps == 1 and g.replays == 0 and not g.graphs


def test_capture_all_runs_every_size_once_on_dummy_decodes():
    g = _graphs()
    seen = []
    g.capture_all(lambda ids, m: seen.append((len(ids), m.slot_mapping.tolist())) or ids, block_size=4)
    assert [n for n, _ in seen] == [1, 2, 4, 8] and g.eager_steps == 4
    assert all(slots == [0] * n for n, slots in seen)  # block 0, before any request holds it


def test_device_metadata_and_decode_splits():
    assert [num_decode_splits(n) for n in (1, 256, 257, 1000, 10**6)] == [1, 1, 2, 4, MAX_SPLITS]
    dm = device_metadata(np.array([[3, 1], [2, 0]]), np.array([7, 2]), np.array([0, 5, 7]), "cpu")
    assert dm.block_tables.dtype == torch.int32 and dm.max_query_len == 5 and not dm.decode_only


def test_ranks_stay_on_the_cpu_with_gloo_unless_the_device_is_cuda():
    from kvflow.distributed.parallel import rank_device
    assert rank_device("cpu", 3) == torch.device("cpu")


def test_cuda_kernel_choice_is_triton_attention_and_torch_gemms():
    pytest.importorskip("triton")
    from kvflow.model.kernels import select_kernels
    k = select_kernels(torch.bfloat16, device="cuda")
    assert k.names["attention"] == "triton-paged" and k.names["linear"] == "torch" and k.pack is None
    assert k.names["norm"] == k.names["rope"] == k.names["kv_write"] == "triton"
    # the state layers: Triton's one-token updates, never the CPU's C kernels
    assert k.state_isa is None and k.names["state"] == k.state_triton.name == "triton"
    assert k.state_triton.gated_delta_chunks.__module__ == "kvflow.model.triton.state_scan"
    assert k.describe().startswith("kernels [cuda]: linear=torch")
    assert k.with_kv_dtype(torch.float32).names == k.names


@pytest.mark.slow
def test_runner_gpu_path_matches_cpu_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "gpu_path_checks.py")], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(re.findall(r"^ok \w+ForCausalLM: ", proc.stdout, re.M)) == 2, proc.stdout[-2000:]


# -- sizing the KV pool by --gpu-memory-utilization, from given numbers ----------------------
GiB = 2**30


def _mem(**kw):
    from kvflow.model.gpu_memory import GpuMemory
    base = dict(total=140 * GiB, free_at_start=139 * GiB, weights=16 * GiB,
                activation_peak=3 * GiB, non_torch=1 * GiB)
    return GpuMemory(**{**base, **kw})


def test_kv_pool_gets_the_fraction_left_after_weights_activations_and_the_rest():
    from kvflow.model.gpu_memory import kv_cache_bytes, num_gpu_blocks
    assert kv_cache_bytes(_mem(), 0.9) == int(140 * GiB * 0.9) - 20 * GiB
    # Llama-3-8B in bf16: 32 layers x 2 x 8 kv heads x 128 x 2 B = 128 KiB per token
    per_token = 32 * 2 * 8 * 128 * 2
    blocks = num_gpu_blocks(_mem(), 0.9, per_token, 16)
    assert blocks == (int(140 * GiB * 0.9) - 20 * GiB) // (per_token * 16)
    assert num_gpu_blocks(_mem(), 0.5, per_token, 16) < blocks


def test_gpu_memory_errors_say_what_to_change():
    from kvflow.model.gpu_memory import kv_cache_bytes, num_gpu_blocks
    with pytest.raises(ValueError, match="only 50.00 GiB was free at start.*lower it"):
        kv_cache_bytes(_mem(free_at_start=50 * GiB), 0.9)
    with pytest.raises(ValueError, match="leaves nothing for the KV cache: raise it"):
        kv_cache_bytes(_mem(weights=123 * GiB), 0.9)
    with pytest.raises(ValueError, match="holds no block"):
        num_gpu_blocks(_mem(total=21 * GiB, free_at_start=21 * GiB, non_torch=0), 0.96,
                       1 << 20, 2048)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        kv_cache_bytes(_mem(), 1.5)


def test_device_and_utilization_options_are_validated():
    from kvflow.config import CacheConfig, ModelConfig
    assert ModelConfig().device == "auto" and CacheConfig().gpu_memory_utilization == 0.9
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        ModelConfig(device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_device_auto_is_the_cpu_here_and_cuda_is_refused_without_a_gpu():
    from kvflow.config import EngineConfig, ModelConfig
    from kvflow.engine.core import EngineCore
    from kvflow.model.loader import resolve_device
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(ValueError, match="device cuda: torch sees no GPU"):
        EngineCore(EngineConfig(model_config=ModelConfig(device="cuda")))


def test_profile_batch_keeps_positions_inside_max_model_len():
    from kvflow.model.gpu_memory import profile_batch
    lens, tables, blocks = profile_batch(2048, 8192, 16)
    assert lens.tolist() == [2048] and blocks == 128 and tables == [list(range(128))]
    lens, tables, blocks = profile_batch(2048, 500, 16)
    assert lens.tolist() == [500, 500, 500, 500, 48] and max(lens) <= 500
    assert blocks == 4 * 32 + 3 and tables[-1] == [128, 129, 130]
