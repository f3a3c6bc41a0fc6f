"""Images on the CPU: time to first token for one 448 x 448 image plus a 64-token question, and
images encoded per second, kvflow against HF transformers on the same Qwen3-VL model.

The model has Qwen3-VL-2B-Instruct's shapes (its ViT: 24 blocks of width 1024 over 16 x 16
patches, DeepStack from blocks 5, 11 and 17, the 2 x 2 merger into 2048; its text model: 28
Qwen3 layers of width 2048, 16 query / 8 KV heads of 128, MLP 6144, vocabulary 151,936, tied
embeddings, interleaved M-RoPE 24/20/20) with random weights in bf16, saved once by `--build`
(about 4.3 GB; no weights are downloaded). `--text-layers` keeps fewer text layers.

Both engines get the same folder, the same images (random pixels, a fresh seed per request, so
kvflow's encoder cache and prefix cache never hit) and the same token ids:
  TTFT: kvflow `LLM.generate` of `<|vision_start|><|image_pad|><|vision_end|>` + 64 question
        ids with max_tokens=1 (wall time; image processing included); HF: the image processor
        (as kvflow calls it) + `generate(max_new_tokens=1)` on the expanded ids (196 image
        tokens for 448 x 448: 28 x 28 patches merged 2 x 2).
  images/s: N distinct images through the vision tower alone: kvflow's `embed_multimodal`
        (what the engine runs for an image) against HF's `get_image_features` on the same
        pixel values.
Each engine runs in its own process (loaded once); after a warm-up round the rounds alternate
between the engines and the medians are reported.

    python benchmarks/image_ttft.py --build --model FOLDER
    python benchmarks/image_ttft.py --model FOLDER --threads 1,2 --rounds 3 --images 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SPECIALS = ("<unk>", "<s>", "</s>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>")
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 4, 5, 6, 7
VOCAB = 151936
SIDE = 448
QUESTION = 64


def build(path: str, text_layers: int) -> None:
    """Random weights with Qwen3-VL-2B-Instruct's shapes, bf16, a byte-level tokenizer that
    knows the vision tokens, and Qwen3-VL's image processor (16-pixel patches, merge 2)."""
    import torch
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest_model_helpers import save_byte_tokenizer

    text = dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144,
                num_hidden_layers=text_layers, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                 "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                  num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
                  hidden_act="gelu_pytorch_tanh", in_channels=3)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                           video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=True,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # never hold an fp32 copy (8.6 GB)
    model = Qwen3VLForConditionalGeneration(config)
    model.to(torch.bfloat16).save_pretrained(path)
    save_byte_tokenizer(path, VOCAB, SPECIALS)
    Qwen2VLImageProcessor(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                          temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                          image_std=[0.5] * 3).save_pretrained(path)


def _image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8))


def _question(seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(10_000 + seed).integers(300, VOCAB - 1000, QUESTION)]


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class HFWorker:
    def __init__(self, path: str):
        import torch
        from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration

        self.torch = torch
        self.model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.proc = AutoImageProcessor.from_pretrained(path)

    def ttft(self, seed: int) -> dict:
        torch = self.torch
        img, q = _image(seed), _question(seed)
        t0, c0 = time.perf_counter(), _cpu()
        px = self.proc([img], return_tensors="pt")
        t, h, w = (int(v) for v in px["image_grid_thw"][0])
        ids = torch.tensor([[VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END] + q])
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      pixel_values=px["pixel_values"],
                                      image_grid_thw=px["image_grid_thw"],
                                      mm_token_type_ids=(ids == IMAGE_PAD).int(),
                                      max_new_tokens=1, do_sample=False)
        assert out.shape[1] == ids.shape[1] + 1
        return {"ttft_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0, "prompt_len": ids.shape[1]}

    def encode(self, seeds: list[int]) -> dict:
        torch = self.torch
        px = self.proc([_image(s) for s in seeds], return_tensors="pt")
        t0, c0 = time.perf_counter(), _cpu()
        with torch.no_grad():
            self.model.get_image_features(px["pixel_values"].to(torch.bfloat16), px["image_grid_thw"])
        dt = time.perf_counter() - t0
        return {"images_s": len(seeds) / dt, "enc_s": dt, "cpu_s": _cpu() - c0}


class KvflowWorker:
    def __init__(self, path: str, threads: int):
        import torch
        from kvflow import LLM
        from kvflow.sampling_params import SamplingParams

        self.torch = torch
        self.llm = LLM(path, dtype="bfloat16", num_threads=threads, quantization="none",
                       max_model_len=1024, num_blocks=128)
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        core = self.llm.engine.core
        self.model = core.executor.runner.model
        from kvflow.multimodal.processor import multimodal_processor
        self.mm = multimodal_processor(path, core.arch, None)

    def ttft(self, seed: int) -> dict:
        from kvflow.multimodal.inputs import image_item

        img, q = _image(seed), _question(seed)
        prompt = {"prompt_token_ids": [VISION_START, IMAGE_PAD, VISION_END] + q,
                  "multi_modal_data": {"image": [image_item(img)]}}
        t0, c0 = time.perf_counter(), _cpu()
        out = self.llm.generate(prompt, self.params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m = out.metrics or {}
        metric = (m["first_token_time"] - m["arrival_time"]
                  if m.get("first_token_time") and m.get("arrival_time") else None)
        return {"ttft_s": wall, "cpu_s": _cpu() - c0, "metrics_ttft_s": metric,
                "prompt_len": len(out.prompt_token_ids)}

    def encode(self, seeds: list[int]) -> dict:
        import numpy as np
        torch = self.torch
        pixels = []
        for s in seeds:
            out = self.mm.image_processor([_image(s)], return_tensors="np")
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
            px = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
            pixels.append(torch.from_numpy(px).view(t, h, w, px.shape[-1]))
        pixels = torch.stack(pixels)
        t0, c0 = time.perf_counter(), _cpu()
        self.model.embed_multimodal(pixels)
        dt = time.perf_counter() - t0
        return {"images_s": len(seeds) / dt, "enc_s": dt, "cpu_s": _cpu() - c0}


def worker(engine: str, path: str, threads: int) -> None:
    import torch
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    w = HFWorker(path) if engine == "hf" else KvflowWorker(path, threads)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "ttft":
            res = w.ttft(cmd["seed"])
        elif cmd["op"] == "encode":
            res = w.encode(cmd["seeds"])
        else:
            break
        print(json.dumps(res), flush=True)


class Proc:
    def __init__(self, engine: str, path: str, threads: int):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=str(threads), KVFLOW_NUM_THREADS=str(threads))
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", engine,
                                   "--model", path, "--threads", str(threads)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("worker exited")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.p.stdin.close()
        self.p.wait()


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "kvflow-image-bench"),
                    help="the model folder (--build writes it; ~4 GB)")
    ap.add_argument("--build", action="store_true", help="save the random model first")
    ap.add_argument("--text-layers", type=int, default=28)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=4, help="distinct images per encode round")
    ap.add_argument("--engines", default="kvflow,hf")
    ap.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/<date>-image-ttft.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.model, int(args.threads))
    if args.build:
        build(args.model, args.text_layers)
        print(f"saved {args.model}", flush=True)
    sys.path.insert(0, HERE)
    import results_io

    start = time.gmtime()
    engines = args.engines.split(",")
    rows, raw = [], []
    seed = 0
    for threads in (int(t) for t in args.threads.split(",")):
        loads = [loadavg()]
        procs = {e: Proc(e, args.model, threads) for e in engines}
        res = {e: {"ttft": [], "ttft_cpu": [], "metrics": [], "img": [], "img_cpu": []} for e in engines}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = engines if rnd % 2 == 0 else engines[::-1]
            for e in order:
                seed += 1
                t = procs[e].ask(op="ttft", seed=seed)
                seeds = list(range(1000 * seed, 1000 * seed + args.images))
                enc = procs[e].ask(op="encode", seeds=seeds)
                raw.append({"threads": threads, "round": rnd, "engine": e, "ttft": t, "encode": enc,
                            "load": loadavg()})
                print(json.dumps(raw[-1]), flush=True)
                if rnd == 0:
                    continue
                r = res[e]
                r["ttft"].append(t["ttft_s"])
                r["ttft_cpu"].append(t["cpu_s"])
                if t.get("metrics_ttft_s"):
                    r["metrics"].append(t["metrics_ttft_s"])
                r["img"].append(enc["images_s"])
                r["img_cpu"].append(enc["cpu_s"] / args.images)
        loads.append(loadavg())
        for p in procs.values():
            p.close()
        med = statistics.median
        for e in engines:
            r = res[e]
            rows.append([e, threads, round(med(r["ttft"]), 2),
                         round(med(r["metrics"]), 2) if r["metrics"] else None,
                         round(med(r["ttft_cpu"]), 2), round(med(r["img"]), 3),
                         round(med(r["img_cpu"]), 2), args.rounds,
                         f"load {loads[0]} -> {loads[1]}"])
            print(rows[-1], flush=True)
    with open(os.path.join(args.model, "config.json")) as f:
        layers = json.load(f)["text_config"]["num_hidden_layers"]
    doc = {
        "schema": results_io.SCHEMA, "kind": "table",
        "title": f"Images: TTFT of one {SIDE}x{SIDE} image + {QUESTION}-token question, and "
                 "images/s through the vision tower, kvflow vs HF transformers (Qwen3-VL-2B shapes, bf16)",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", start), "end": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "commit": results_io.git_commit(ROOT),
        "command": "python benchmarks/image_ttft.py " + " ".join(
            "FOLDER" if a == args.model else a for a in sys.argv[1:]),
        "cpu": results_io.cpu_info(),
        "source": "measured by benchmarks/image_ttft.py",
        "notes": [
            f"Model: random weights with Qwen3-VL-2B-Instruct's shapes ({layers} text layers of 28), bf16, "
            "built by --build; shapes as in that model's config.json (ViT depth 24 width 1024, "
            "patch 16, DeepStack 5/11/17; text width 2048, 16/8 heads of 128, MLP 6144, vocab 151936).",
            f"Prompt: <|vision_start|><|image_pad|><|vision_end|> + {QUESTION} random ids; the image "
            f"expands to 196 tokens (prompt {SIDE}x{SIDE} -> 262 tokens); max_tokens 1; fresh image "
            "and question per request (no encoder or prefix cache hits).",
            "TTFT: wall time of the whole call, image processing included (kvflow: LLM.generate; HF: "
            "the image processor + generate(max_new_tokens=1)); 'kvflow metrics' = first_token_time - "
            "arrival_time from the request's metrics.",
            f"images/s: {args.images} distinct images per round through the vision tower alone (kvflow: "
            "the model's embed_multimodal, one image at a time as the engine runs it; HF: "
            "get_image_features on all of them at once).",
            "CPU s: user+system of the engine's process over the call (the machine has 2 vCPUs).",
            f"Each engine in its own process, loaded once; a warm-up round, then {args.rounds} rounds "
            "alternating the engines' order; medians. The host was shared (other builds and test "
            "runs): see the load averages.",
        ],
        "columns": ["engine", "threads", "TTFT s (median)", "kvflow metrics TTFT s", "TTFT CPU s",
                    "images/s", "CPU s per image", "rounds", "host load (1/5/15 min)"],
        "rows": rows,
        "runs": raw,
    }
    out = args.out or os.path.join(results_io.RESULTS, time.strftime("%Y%m%d-%H%M", start) + "-image-ttft.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
