"""kvflow on an NVIDIA GPU, checked and measured in one run (written for a single H200 with
torch 2.11 + CUDA 13, Triton 3.6, transformers 5.17 and no internet; ~10 minutes).

    pip install --no-deps -e .            # kvflow itself; msgspec and pytest must be there too
    python benchmarks/gpu_check.py --out gpu_report.json

What it does, in order, printing one report at the end (and writing it as JSON with --out):

1. kernels: tests/triton_kernel_checks.py and triton_sink_checks.py (the Triton paged
   attention, with and without attention sinks, against a PyTorch reference) compiled and run
   on the GPU, in a pytest subprocess.
2. for each model shape (SmolLM2-135M's and Llama-3-8B's, random weights built from a
   `transformers` config on the GPU, bf16; no weights are carried there):
   - engine (SmolLM2's shape): the model saved as an HF folder and served by kvflow's
     EngineCore with --device cuda: its own --gpu-memory-utilization sizing, CUDA graphs, the
     start-up line, and greedy tokens checked against HF as below.
   - equivalence: kvflow's greedy tokens against HF transformers on the same weights. With
     random weights many logits nearly tie, so the rule is the CPU bf16 tests': each kvflow
     token is within HF's top-3 at its position (HF run over kvflow's own prefix); the share
     of exact agreement with HF's argmax is reported beside it.
   - W1: 128 prompts of U[32, 512] random tokens, 128 output tokens each (ignore_eos): kvflow's
     output tokens/s, HF `generate` with static batching on the same GPU, and the roofline
     (max of FLOPs / peak and bytes / bandwidth, a lower bound on the time).
   - batch 1: one 128-token prompt, 256 tokens decoded: decode tokens/s (with CUDA graphs, and
     eager) against the bandwidth limit (weights + KV read once per token) and HF `generate`.
   vLLM cannot be installed there (no internet), so no vLLM figure is measured.

`--dry-run` runs the same code on the CPU with tiny shapes, the Triton kernels through Triton's
interpreter and CUDA graphs off (tests/test_gpu_check.py runs it), so the script is known to
work before GPU time is spent on it."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["torch", "triton", "transformers", "numpy", "msgspec", "safetensors"]

# (name, transformers LlamaConfig kwargs): the real models' shapes, random weights
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, rms_norm_eps=1e-5,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                 rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU: tiny shapes, Triton's interpreter, no CUDA graphs")
    p.add_argument("--models", default=None,
                   help="comma-separated shapes (default: smollm2-135m,llama3-8b; dry run: tiny)")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out: "
                   "kernels, engine, equivalence, w1, batch1, hf")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--w1-prompts", type=int, default=None, help="W1 prompts (128; dry run 4)")
    p.add_argument("--w1-output", type=int, default=None, help="W1 tokens out each (128; dry run 8)")
    p.add_argument("--hf-batch", type=int, default=128, help="HF generate's static batch size")
    p.add_argument("--bandwidth-tbs", type=float, default=4.3,
                   help="device copy bandwidth, TB/s (measured ~4.3 on the H200s)")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="bf16 dense matmul rate, TFLOP/s (measured ~790 on the H200s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="the KV pool's sizing; HF's copy of the model shares the GPU")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--engine-shapes", default="smollm2-135m,tiny",
                   help="shapes also run through EngineCore from a saved HF folder (section "
                   "`engine`; the 8B one is not saved: 16 GB to disk)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="skip what is left after this many seconds (the device runs a command "
                   "for at most 600 s); every finished part is already in --out")
    args = p.parse_args(argv)
    args.started, args.report = time.perf_counter(), None
    return args


# -- the workloads ------------------------------------------------------------------------------
def w1_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def build_models(shape: dict, dtype, device, dry_run: bool, seed: int):
    """HF LlamaForCausalLM with random weights (norms perturbed, so they are not all ones) and
    kvflow's model on the same tensors' values, both on `device` in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    from kvflow.model.arch import load_arch_config
    from kvflow.model.kernels import select_kernels
    from kvflow.models.llama import LlamaForCausalLM
    from kvflow.checkpoint.conversion_cache import fuse_weights

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = HFLlama(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.eval()
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        arch = load_arch_config(tmp)
    # the GPU kernel set; in a dry run the same set on CPU tensors under the interpreter
    kernels = select_kernels(dtype, device="cuda")
    model = LlamaForCausalLM(arch, dtype, device="meta", kernels=kernels)
    with torch.no_grad():
        weights = fuse_weights({k: v.detach() for k, v in hf.state_dict().items()}, arch, dtype)
        weights = {k: v.clone() for k, v in weights.items()}  # its own copy, like a real load
    model.load_state_dict(weights, strict=True, assign=True)
    model.eval()
    model.to(device)
    return hf, model, arch


class Engine:
    """kvflow's scheduler and runner, as EngineCore puts them together on a GPU (without the
    tokenizer and the processes, which this check does not need)."""

    def __init__(self, model, arch, dtype, device, args, max_model_len: int, free_at_start: int,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 2048, block_size: int = 16):
        import torch

        from kvflow.config import CacheConfig, SchedulerConfig
        from kvflow.core.scheduler import Scheduler
        from kvflow.model import gpu_memory
        from kvflow.model.cuda_graphs import decode_graphs_for
        from kvflow.model.sharding import kv_bytes_per_token_per_rank
        from kvflow.worker.model_runner import ModelRunner

        self.device = device
        self.kv_bytes_per_token = kv_bytes_per_token_per_rank(arch, 1, dtype.itemsize)
        self.memory = None
        if device.type == "cuda":
            self.memory = gpu_memory.measure(model, arch, dtype, block_size, max_num_batched_tokens,
                                             max_num_seqs, max_model_len, device, free_at_start)
            num_blocks = gpu_memory.num_gpu_blocks(self.memory, args.gpu_memory_utilization,
                                                   self.kv_bytes_per_token, block_size)
        else:
            num_blocks = 512
        graphs = decode_graphs_for(arch, block_size, max_num_seqs, max_model_len, device,
                                   capture=device.type == "cuda" and not args.enforce_eager)
        self.runner = ModelRunner(model, arch, num_blocks, block_size, dtype, None, device=device,
                                  graphs=graphs)
        t0 = time.perf_counter()
        self.runner.capture_graphs()
        self.capture_seconds = time.perf_counter() - t0
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len),
            CacheConfig(block_size=block_size, num_blocks=num_blocks))
        self._ids = 0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
        """Greedy, ignore_eos; (outputs, timing: total seconds and first-token time of the first)."""
        from kvflow.request import Request
        from kvflow.sampling_params import SamplingParams

        reqs = []
        for p in prompts:
            self._ids += 1
            reqs.append(Request(f"g{self._ids}", list(p), SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
            self.scheduler.add_request(reqs[-1])
        self._sync()
        t0 = time.perf_counter()
        first = None
        steps = 0
        while self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()
            sampled = self.runner.execute(out).sampled
            self.scheduler.update_from_output(out, sampled)
            steps += 1
            if first is None and reqs[0].output_token_ids:
                first = time.perf_counter() - t0
        self._sync()
        total = time.perf_counter() - t0
        return [list(r.output_token_ids) for r in reqs], {"seconds": total, "first_token_s": first,
                                                         "steps": steps}


def hf_generate(hf, prompts: list[list[int]], max_tokens: int, batch: int, device) -> tuple[list[list[int]], float]:
    """HF `generate`, greedy, static batches of `batch` (left-padded), exactly max_tokens each."""
    import torch

    outs, t0 = [], None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=0)
        outs += gen[:, width:].tolist()
    sync()
    return outs, time.perf_counter() - t0


def ranks_under_hf(hf, prompts, outputs, device) -> list[int]:
    """Rank of each kvflow token in HF's logits at its position, HF run over kvflow's prefix."""
    import torch

    ranks = []
    with torch.inference_mode():
        for p, o in zip(prompts, outputs):
            seq = torch.tensor([p + o], device=device)
            logits = hf(seq).logits[0, len(p) - 1:len(p) - 1 + len(o)].float()
            chosen = logits.gather(1, torch.tensor(o, device=device)[:, None])
            ranks += (logits > chosen).sum(dim=1).tolist()
    return ranks


# -- the roofline ---------------------------------------------------------------------------------
def model_numbers(arch) -> dict:
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return {"matmul_params": arch.num_hidden_layers * layer, "lm_head": h * arch.vocab_size,
            "kv_elems_per_token": arch.num_hidden_layers * 2 * kv,
            "attn_flops_per_key": arch.num_hidden_layers * 4 * q}


def roofline_w1(arch, weight_bytes: int, prompt_lens: list[int], out_len: int, elem: int,
                bw: float, peak: float) -> dict:
    """A lower bound on W1's time: every prompt token through the projections, every output
    token through the projections and the LM head, attention over each token's keys (FLOPs);
    the weights read once per decode step, all running together, and each step reading the
    batch's K/V (bytes). Output tokens/s at max(FLOPs / peak, bytes / bandwidth)."""
    m = model_numbers(arch)
    n_out = len(prompt_lens) * out_len
    flops = 2 * m["matmul_params"] * (sum(prompt_lens) + n_out) + 2 * m["lm_head"] * n_out
    flops += sum(m["attn_flops_per_key"] * p * p / 2 for p in prompt_lens)
    keys_read = sum(p * out_len + out_len * (out_len - 1) / 2 for p in prompt_lens)
    flops += m["attn_flops_per_key"] * keys_read
    bytes_ = weight_bytes * out_len + keys_read * m["kv_elems_per_token"] * elem
    t = max(flops / peak, bytes_ / bw)
    return {"flops": flops, "bytes": bytes_, "seconds": t, "output_tok_s": n_out / t,
            "bound": "compute" if flops / peak > bytes_ / bw else "bandwidth"}


def bandwidth_limit_batch1(arch, weight_bytes: int, prompt_len: int, out_len: int, elem: int,
                           bw: float) -> float:
    avg_keys = prompt_len + out_len / 2
    per_token = weight_bytes + avg_keys * model_numbers(arch)["kv_elems_per_token"] * elem
    return bw / per_token


# -- the sections ---------------------------------------------------------------------------------
def run_kernel_tests(device_type: str) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"ok": False, "summary": "not run: pytest is not installed", "seconds": 0.0,
                "output_tail": ""}
    env = {**os.environ, "KERNEL_CHECKS_DEVICE": device_type,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if device_type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "triton_kernel_checks.py"),
                           str(ROOT / "tests" / "triton_sink_checks.py")],
                          cwd=ROOT / "tests", env=env, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-300:]]
    return {"ok": proc.returncode == 0, "summary": tail[0], "seconds": time.perf_counter() - t0,
            "output_tail": proc.stdout[-3000:] if proc.returncode else ""}


def engine_core_run(hf, arch, dtype, device, args) -> dict:
    """The product path: the HF folder saved, kvflow's EngineCore started on it with --device
    and --gpu-memory-utilization (the pool sized by its own profile run, CUDA graphs captured,
    the start-up line), a few greedy requests stepped through it and checked against HF."""
    import torch

    from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvflow.engine.core import EngineCore
    from kvflow.engine.protocol import EngineCoreRequest
    from kvflow.sampling_params import SamplingParams

    prompts = w1_prompts(8, 8, 24 if args.dry_run else 200, arch.vocab_size, args.seed + 3)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        t0 = time.perf_counter()
        core = EngineCore(EngineConfig(
            model_config=ModelConfig(model=tmp, device=device.type, enforce_eager=args.enforce_eager,
                                     dtype=str(dtype).removeprefix("torch."),
                                     max_model_len=min(1024, arch.max_position_embeddings)),
            cache_config=CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization,
                                     num_blocks=None if device.type == "cuda" else 256),
            scheduler_config=SchedulerConfig(max_num_seqs=8 if args.dry_run else 64)))
        startup_s = time.perf_counter() - t0
        try:
            for i, p in enumerate(prompts):
                core.add_request(EngineCoreRequest(f"e{i}", p, SamplingParams(
                    temperature=0.0, max_tokens=16, ignore_eos=True)))
            outs: dict[str, list[int]] = {}
            while core.has_unfinished_requests():
                for o in core.step().outputs:
                    outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            report_line = core.startup_report()
        finally:
            core.shutdown()
            del core
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ranks = ranks_under_hf(hf, prompts, [outs[f"e{i}"] for i in range(len(prompts))], device)
    return {"startup_report": report_line, "startup_s": startup_s, "tokens": len(ranks),
            "exact": sum(r == 0 for r in ranks) / len(ranks), "max_rank": max(ranks),
            "ok": max(ranks) < 3}


def check_model(name: str, args, device, report: dict) -> None:
    import torch

    dry = args.dry_run
    dtype = torch.float32 if dry else torch.bfloat16
    skip = set(filter(None, args.skip.split(",")))
    sec: dict = {"shape": name, "dtype": str(dtype).removeprefix("torch.")}
    report["models"].append(sec)
    free_at_start = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    t0 = time.perf_counter()
    hf, model, arch = build_models(SHAPES[name], dtype, device, dry, args.seed)
    progress(args, f"{name} built", {"seconds": round(time.perf_counter() - t0, 1)})
    if "engine" not in skip and name in args.engine_shapes.split(",") and not over_budget(args):
        # first, while the GPU holds only the two models: EngineCore sizes its own pool
        import traceback
        try:
            sec["engine_core"] = engine_core_run(hf, arch, dtype, device, args)
        except Exception:  # noqa: BLE001
            sec["engine_core"] = {"error": traceback.format_exc()[-3000:]}
        progress(args, f"{name} engine_core", sec["engine_core"])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sec["build_s"] = round(time.perf_counter() - t0, 1)
    sec["weight_bytes"] = weight_bytes
    max_model_len = 1024 if not dry else 256
    engine = Engine(model, arch, dtype, device, args, max_model_len, free_at_start,
                    max_num_seqs=8 if dry else 128)
    sec["num_blocks"] = engine.num_blocks
    sec["graph_capture_s"] = round(engine.capture_seconds, 2)
    if engine.memory is not None:
        sec["gpu_memory"] = {k: getattr(engine.memory, k) for k in
                             ("total", "free_at_start", "weights", "activation_peak", "non_torch")}

    try:
        run_sections(sec, engine, hf, arch, weight_bytes, dtype, device, args, skip)
    finally:
        del engine, model, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()


def over_budget(args) -> bool:
    """Past --budget-s: the sections left are skipped, so the report still comes out."""
    return time.perf_counter() - args.started > args.budget_s


def progress(args, what: str, result) -> None:
    """One line as each part ends (a run cut short still shows how far it got), and the report
    so far written to --out."""
    print(f"[{time.perf_counter() - args.started:5.0f}s] {what}: "
          f"{json.dumps(result, default=str)[:400]}", flush=True)
    if args.out and args.report is not None:
        Path(args.out).write_text(json.dumps(args.report, indent=1, default=str))


def run_sections(sec: dict, engine, hf, arch, weight_bytes: int, dtype, device, args, skip) -> None:
    """Each section on its own: one that fails leaves its traceback and the next still runs."""
    import traceback

    for name, fn in (("equivalence", equivalence), ("w1", w1), ("batch1", batch1)):
        if name in skip:
            continue
        if over_budget(args):
            sec[name] = {"error": f"skipped: past the {args.budget_s:.0f}s budget"}
            continue
        try:
            sec[name] = fn(engine, hf, arch, weight_bytes, dtype, device, args, skip)
        except Exception:  # noqa: BLE001
            sec[name] = {"error": traceback.format_exc()[-3000:]}
        progress(args, f"{sec['shape']} {name}", sec[name])


def equivalence(engine, hf, arch, weight_bytes, dtype, device, args, skip) -> dict:
    prompts = w1_prompts(4, 8, 24 if args.dry_run else 64, arch.vocab_size, args.seed + 1)
    outs, _ = engine.generate(prompts, 8 if args.dry_run else 32)
    ranks = ranks_under_hf(hf, prompts, outs, device)
    return {"tokens": len(ranks), "exact": sum(r == 0 for r in ranks) / len(ranks),
            "max_rank": max(ranks), "ok": max(ranks) < 3}


def w1(engine, hf, arch, weight_bytes, dtype, device, args, skip) -> dict:
    dry = args.dry_run
    n_prompts = args.w1_prompts or (4 if dry else 128)
    out_len = args.w1_output or (8 if dry else 128)
    prompts = w1_prompts(n_prompts, 8 if dry else 32, 24 if dry else 512, arch.vocab_size, args.seed)
    engine.generate(prompts[:2], 4)  # warm: Triton compiles the prefill kernel's variants
    outs, timing = engine.generate(prompts, out_len)
    assert all(len(o) == out_len for o in outs)
    r = {"prompts": n_prompts, "prompt_tokens": sum(map(len, prompts)), "output_len": out_len,
         "kvflow_s": timing["seconds"], "kvflow_output_tok_s": n_prompts * out_len / timing["seconds"],
         "kvflow_steps": timing["steps"]}
    roof = roofline_w1(arch, weight_bytes, list(map(len, prompts)), out_len, dtype.itemsize,
                       args.bandwidth_tbs * 1e12, args.peak_tflops * 1e12)
    r["roofline_output_tok_s"] = roof["output_tok_s"]
    r["roofline_bound"] = roof["bound"]
    r["kvflow_of_roofline"] = r["kvflow_output_tok_s"] / roof["output_tok_s"]
    if "hf" not in skip:
        _, hf_s = hf_generate(hf, prompts, out_len, args.hf_batch, device)
        r["hf_s"] = hf_s
        r["hf_output_tok_s"] = n_prompts * out_len / hf_s
        r["kvflow_over_hf"] = r["kvflow_output_tok_s"] / r["hf_output_tok_s"]
    return r


def batch1(engine, hf, arch, weight_bytes, dtype, device, args, skip) -> dict:
    p_len, out_len = (8, 8) if args.dry_run else (128, 256)
    prompt = w1_prompts(1, p_len, p_len, arch.vocab_size, args.seed + 2)
    _, timing = engine.generate(prompt, out_len)
    decode_s = timing["seconds"] - (timing["first_token_s"] or 0.0)
    r = {"prompt_len": p_len, "output_len": out_len,
         "kvflow_decode_tok_s": (out_len - 1) / decode_s,
         "bandwidth_limit_tok_s": bandwidth_limit_batch1(arch, weight_bytes, p_len, out_len,
                                                         dtype.itemsize, args.bandwidth_tbs * 1e12)}
    r["kvflow_of_limit"] = r["kvflow_decode_tok_s"] / r["bandwidth_limit_tok_s"]
    graphs, engine.runner.graphs = engine.runner.graphs, None  # the same decode, eager
    try:
        _, timing = engine.generate(prompt, out_len)
    finally:
        engine.runner.graphs = graphs
    r["kvflow_eager_decode_tok_s"] = (out_len - 1) / (timing["seconds"] - (timing["first_token_s"] or 0.0))
    if "hf" not in skip:
        _, hf_s = hf_generate(hf, prompt, out_len, 1, device)
        r["hf_tok_s"] = out_len / hf_s  # prefill included: a slight underestimate
    return r


def render(report: dict) -> str:
    e = report["env"]
    lines = [f"kvflow gpu_check on {e['device_name']} (torch {e['torch']}, CUDA {e['cuda']}, "
             f"triton {e['triton']}, transformers {e['transformers']}); dry run: {e['dry_run']}"]
    if "kernels" in report:
        k = report["kernels"]
        lines.append(f"kernel tests: {'PASS' if k['ok'] else 'FAIL'} ({k['summary']}, {k['seconds']:.0f}s)")
    for m in report["models"]:
        if "error" in m and "num_blocks" not in m:
            lines.append(f"[{m['shape']}] FAILED before measuring:\n{m['error']}")
            continue
        lines.append(f"[{m['shape']}] {m['dtype']}, weights {m['weight_bytes'] / 2**30:.2f} GiB, "
                     f"{m['num_blocks']} KV blocks, graph capture {m['graph_capture_s']}s")
        if "gpu_memory" in m:
            g = {k: v / 2**30 for k, v in m["gpu_memory"].items()}
            lines.append(f"  GPU memory (GiB): total {g['total']:.1f}, free at start "
                         f"{g['free_at_start']:.1f}, weights {g['weights']:.2f} (HF's copy included), "
                         f"activation peak {g['activation_peak']:.2f}, outside torch {g['non_torch']:.2f}")
        if "error" in m:
            lines.append(f"  FAILED:\n{m['error']}")
        if "engine_core" in m:
            c = m["engine_core"]
            if "error" in c:
                lines.append(f"  EngineCore FAILED:\n{c['error']}")
            else:
                lines.append(f"  EngineCore: {'PASS' if c['ok'] else 'FAIL'} ({c['tokens']} tokens, "
                             f"{c['exact']:.0%} HF's argmax, worst rank {c['max_rank']}); started in "
                             f"{c['startup_s']:.1f}s: {c['startup_report']}")
        for name in ("equivalence", "w1", "batch1"):
            if "error" in m.get(name, {}):
                lines.append(f"  {name} FAILED:\n{m[name]['error']}")
        if "ok" in m.get("equivalence", {}):
            q = m["equivalence"]
            lines.append(f"  greedy vs HF: {'PASS' if q['ok'] else 'FAIL'} ({q['tokens']} tokens, "
                         f"{q['exact']:.0%} HF's argmax, worst rank {q['max_rank']}; rule: top-3)")
        if "kvflow_s" in m.get("w1", {}):
            w = m["w1"]
            hf = (f", HF generate {w['hf_output_tok_s']:.0f} tok/s (kvflow x{w['kvflow_over_hf']:.2f})"
                  if "hf_output_tok_s" in w else "")
            lines.append(f"  W1 ({w['prompts']} prompts, {w['output_len']} out): kvflow "
                         f"{w['kvflow_output_tok_s']:.0f} output tok/s{hf}; roofline "
                         f"{w['roofline_output_tok_s']:.0f} ({w['roofline_bound']}-bound), kvflow at "
                         f"{w['kvflow_of_roofline']:.1%}")
        if "kvflow_decode_tok_s" in m.get("batch1", {}):
            b = m["batch1"]
            hf = f", HF generate {b['hf_tok_s']:.0f} tok/s" if "hf_tok_s" in b else ""
            lines.append(f"  batch 1 decode: kvflow {b['kvflow_decode_tok_s']:.0f} tok/s (eager "
                         f"{b['kvflow_eager_decode_tok_s']:.0f}){hf}; "
                         f"bandwidth limit {b['bandwidth_limit_tok_s']:.0f} tok/s, kvflow at "
                         f"{b['kvflow_of_limit']:.1%}")
    lines.append("vLLM: not installable on this machine (no internet); no vLLM figure measured.")
    lines.append(f"total {report['seconds']:.0f}s")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:  # before triton is first imported, or the interpreter is not used
        os.environ["TRITON_INTERPRET"] = "1"
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing Python packages: {', '.join(missing)} (bring their wheels; kvflow was "
              "installed with --no-deps)", file=sys.stderr)
        return 2
    import torch
    import transformers
    import triton

    sys.path.insert(0, str(ROOT))
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no GPU visible to torch; --dry-run runs this on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    report = {"env": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                      "transformers": transformers.__version__, "dry_run": args.dry_run,
                      "device_name": torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)"},
              "models": []}
    args.report = report
    skip = set(filter(None, args.skip.split(",")))
    if "kernels" not in skip:
        report["kernels"] = run_kernel_tests(device.type)
        progress(args, "kernel tests", report["kernels"])
    models = (args.models or ("tiny" if args.dry_run else "smollm2-135m,llama3-8b")).split(",")
    for name in models:
        if name not in SHAPES:
            print(f"unknown shape {name!r}; known: {', '.join(SHAPES)}", file=sys.stderr)
            return 2
        if over_budget(args):
            report["models"].append({"shape": name, "error": f"skipped: past the {args.budget_s:.0f}s budget"})
            continue
        try:  # a failure is reported and the next shape still runs: GPU time is scarce
            check_model(name, args, device, report)
        except Exception:  # noqa: BLE001
            import traceback
            report["models"].append({"shape": name, "error": traceback.format_exc()[-3000:]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - args.started
    text = render(report)
    report["text"] = text
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    ok = report.get("kernels", {}).get("ok", True) and all(
        "error" not in m
        and all("error" not in m.get(k, {}) for k in ("engine_core", "equivalence", "w1", "batch1"))
        and m.get("equivalence", {}).get("ok", True) and m.get("engine_core", {}).get("ok", True)
        for m in report["models"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
