"""The runner's GPU path on CPU tensors: the GPU kernel set (torch GEMMs, Triton attention and
KV write under Triton's interpreter) and decode steps through the CUDA-graph buffers with
capture off, against the CPU kernel set on the same tiny model, step by step under the real
scheduler (chunked prefill, mixed steps, padded decode batches). Run in its own process with
TRITON_INTERPRET=1 by tests/test_gpu_path.py; prints `ok` and what it exercised per model."""
from __future__ import annotations

import os
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (before triton is imported)")

import torch  # noqa: E402

from conftest_model_helpers import save_tiny_llama3  # noqa: E402
from tiny_arch_models import save_phi3  # noqa: E402
from kvflow.config import CacheConfig, SchedulerConfig  # noqa: E402
from kvflow.core.scheduler import Scheduler  # noqa: E402
from kvflow.model.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from kvflow.model.kernels import select_kernels  # noqa: E402
from kvflow.model.loader import load_model  # noqa: E402
from kvflow.request import Request  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402
from kvflow.worker.model_runner import ModelRunner  # noqa: E402


def check(path: str, block_size: int = 4, num_blocks: int = 96) -> str:
    """One tiny model, CPU kernels against the GPU kernel set step by step; what it exercised."""
    cpu_model, arch = load_model(path, torch.float32)
    gpu_set = select_kernels(torch.float32, device="cuda")  # chosen for cuda, run here
    assert gpu_set.names["attention"] == "triton-paged", gpu_set.names
    gpu_model, _ = load_model(path, torch.float32, kernels=gpu_set)
    graphs = DecodeGraphs(capture_sizes(8), max_blocks=arch.max_position_embeddings // block_size,
                          num_heads=arch.num_attention_heads, head_dim=arch.head_dim, num_splits=2,
                          device="cpu", capture=False)
    assert graphs.sizes == [1, 2, 4, 8]
    ref = ModelRunner(cpu_model, arch, num_blocks, block_size, torch.float32, None)
    gpu = ModelRunner(gpu_model, arch, num_blocks, block_size, torch.float32, None, graphs=graphs)

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=8, max_model_len=256),
                      CacheConfig(block_size=block_size, num_blocks=num_blocks))
    gen = torch.Generator().manual_seed(1)
    lens = [17, 5, 1, 9]
    for i, n in enumerate(lens):
        # one seeded sampled request: the sampler's path on the GPU set too
        params = (SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=3 + i, ignore_eos=True)
                  if i == 1 else SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True))
        sched.add_request(Request(f"r{i}", torch.randint(0, arch.vocab_size, (n,), generator=gen).tolist(),
                                  params))
    steps = mixed = padded = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        want = ref.execute(out)
        before = graphs.eager_steps
        got = gpu.execute(out)
        assert got.sampled == want.sampled, (path, out.num_scheduled_tokens, got.sampled, want.sampled)
        n = len(out.num_scheduled_tokens)
        if graphs.eager_steps > before and graphs.padded_size(n) > n:
            padded += 1
        mixed += out.total_num_scheduled_tokens > n and any(v == 1 for v in out.num_scheduled_tokens.values())
        sched.update_from_output(out, want.sampled)
        steps += 1
    for (k0, v0), (k1, v1) in zip(ref.kv_caches, gpu.kv_caches):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)
    assert graphs.eager_steps > 0 and padded > 0 and mixed > 0, (graphs.eager_steps, padded, mixed)
    # the memory profile's step (gpu_memory.py) through the GPU kernel set: a batch longer than
    # max_model_len is cut into sequences that keep positions inside the RoPE table
    from kvflow.model.gpu_memory import run_profile_step
    cache_bytes = run_profile_step(gpu_model, arch, torch.float32, block_size, num_tokens=70,
                                   num_seqs=8, max_model_len=32, device="cpu")
    per_block = 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * 4
    assert cache_bytes == (8 + 8 + 2) * per_block, cache_bytes
    return f"{arch.architecture}: steps={steps} graph_steps={graphs.eager_steps} padded={padded} mixed={mixed}"


def main() -> None:
    torch.manual_seed(0)
    # Llama 3 (GQA, llama3 RoPE, the fused RoPE kernel), Phi-3 (partial LongRoPE in PyTorch,
    # positions from the graph buffers on the device)
    for save in (save_tiny_llama3, save_phi3):
        with tempfile.TemporaryDirectory() as tmp:
            print("ok", check(save(tmp)))


if __name__ == "__main__":
    main()
