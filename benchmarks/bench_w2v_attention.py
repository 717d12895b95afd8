"""w2v-BERT's relative-position attention: transformers' module against ours (data/audio/w2v_attention.py), on one CPU
thread by chunk length, or on a GPU (--device cuda) as the whole model's audio seconds per second.

CPU (the default). A random Wav2Vec2BertModel with w2v-BERT 2.0's positions (relative_key, left 64, right 8), 4
layers of hidden 256 (intermediate 1024, 4 heads; the other fields at Wav2Vec2BertConfig's defaults), saved and
loaded through data/audio/features.py's W2vBertLayer (layer 4), runs one chunk per forward pass of 5, 10, 20 and
30 s (50 frames a second). Four models, timed interleaved, best of --repeats:
- stock: transformers' attention (a [T, T, head_dim] table, a [B, H, T, T] bias);
- ours: RelativeKeySelfAttention as a CPU runs it: per block of queries, the near keys' bias gathered from a
  [B, H, T, 73] table, the far keys' bias folded into the keys;
- gathered: ours with the bias of every key gathered into SDPA's mask (its fallback kernel);
- unbiased: ours with the bias left out: not w2v-BERT, the cost of the same model's attention without positions,
  so ours - unbiased is what the bias still costs and unbiased itself what attention's T^2 work leaves.
Figures: ms of model time per audio second (the forward pass's CPU time on its one thread, which a busy machine
inflates less than wall time), and each model's audio seconds per second on 30-s chunks as a share of that on
5-s chunks.

GPU (--device cuda). A w2v-BERT-2.0-sized random model to layer 17 (hidden 1024, 16 heads, intermediate 4096) in
bfloat16, made on the device, one fixed batch repeated: 64 inputs of 10 s, or 21 of 30 s, each as it is and with
its first row half padded. The same weights run with each attention kernel in turn, interleaved, rounds of
passes timed with CUDA events: transformers' stock module, each of ours that runs here (flex, gather, triton,
and the Triton kernel with other tiles, --triton_tiles), and the model with no position bias at all (not
w2v-BERT: the ceiling of its other work). Figures: audio seconds per second of the whole model (the real frames
of the batch over the median pass time), each kernel against stock and against no bias, and each kernel's
largest error against stock, relative to stock's largest value. --cpu-only runs the same steps at toy sizes on
this machine's CPU in float32 (the Triton kernel under TRITON_INTERPRET=1 only), to check the script.

    python benchmarks/bench_w2v_attention.py [--repeats 7] [--out benchmarks/results/bench_w2v_attention.json]
                                             [--table /tmp/figs/attention.md]
    python benchmarks/bench_w2v_attention.py --device cuda [--rounds 3] [--passes 3]
                                             [--triton_tiles 128x128x8x3,64x64x4x3]
    python benchmarks/bench_w2v_attention.py --cpu-only
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from data.audio.features import FRAME_RATE, W2vBertLayer  # noqa: E402
from data.audio.w2v_attention import RelativeKeySelfAttention, key_padding  # noqa: E402

SECONDS = (5, 10, 20, 30)
CONFIG = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024,
          "position_embeddings_type": "relative_key", "left_max_position_embeddings": 64,
          "right_max_position_embeddings": 8}
MODELS = ("stock", "ours", "gathered", "unbiased")


class UnbiasedAttention(RelativeKeySelfAttention):
    """Ours without the relative-position bias: SDPA on q, k, v and the padding alone (a timing floor)."""

    def forward(self, hidden_states, attention_mask=None, relative_position_embeddings=None, **kwargs):
        batch, length, _ = hidden_states.shape
        shape = (batch, length, self.num_heads, self.head_size)
        q, k, v = (linear(hidden_states).view(shape).transpose(1, 2)
                   for linear in (self.linear_q, self.linear_k, self.linear_v))
        valid = key_padding(attention_mask, batch, length)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if valid is None else valid[:, None, None, :],
                                             scale=self.scaling)
        return self.linear_out(out.transpose(1, 2).reshape(batch, length, -1)), None


def load(folder: Path, model: str) -> W2vBertLayer:
    layer = W2vBertLayer(folder, CONFIG["num_hidden_layers"], device=torch.device("cpu"), dtype=torch.float32,
                         max_chunk_seconds=max(SECONDS), attention="stock" if model == "stock" else "fast")
    for encoder_layer in layer.model.encoder.layers:
        if model == "gathered":
            encoder_layer.self_attn.kernel = "gather"
        if model == "unbiased":
            encoder_layer.self_attn.__class__ = UnbiasedAttention
    return layer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: the one-thread table by chunk length; cuda: the whole model by kernel")
    parser.add_argument("--cpu-only", dest="cpu_only", action="store_true",
                        help="the GPU mode's steps on this CPU at toy sizes, to check the script")
    parser.add_argument("--rounds", type=int, default=3, help="GPU mode: rounds over every kernel and batch")
    parser.add_argument("--passes", type=int, default=3, help="GPU mode: passes timed per kernel, batch and round")
    parser.add_argument("--triton_tiles", default="128x128x8x3,64x64x4x3,128x32x4x3",
                        help="GPU mode: other tiles of the Triton kernel to time, BLOCK_MxBLOCK_NxWARPSxSTAGES, "
                             "comma-separated ('' for none)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/bench_w2v_attention.json (CPU), "
                             "bench_w2v_attention_gpu.json (GPU), bench_w2v_attention_cpu_only.json (--cpu-only)")
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.device == "cuda" or args.cpu_only:
        return by_kernel(args)
    args.out = args.out or REPO / "benchmarks" / "results" / "bench_w2v_attention.json"
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        Wav2Vec2BertModel(Wav2Vec2BertConfig(**CONFIG)).eval().save_pretrained(folder)
        layers = {model: load(Path(folder), model) for model in MODELS}
    rng = np.random.default_rng(0)
    chunks = {s: rng.standard_normal((s * FRAME_RATE, 160)).astype(np.float32) for s in SECONDS}
    best = {(model, s): float("inf") for model in MODELS for s in SECONDS}
    error = {}
    for s in SECONDS:  # warm-up, and ours against stock
        outs = {model: layers[model].forward([chunks[s]])[0] for model in MODELS}
        error[s] = float(np.abs(outs["ours"] - outs["stock"]).max() / np.abs(outs["stock"]).max())
    for _ in range(args.repeats):
        for s in SECONDS:
            for model in MODELS:
                start = time.thread_time()
                layers[model].forward([chunks[s]])
                best[model, s] = min(best[model, s], time.thread_time() - start)
    rows = [{"seconds": s, "frames": s * FRAME_RATE, "ours_vs_stock_relative_error": error[s],
             **{f"{model}_ms_per_audio_second": round(best[model, s] / s * 1e3, 2) for model in MODELS}}
            for s in SECONDS]
    ratio = {model: round((best[model, SECONDS[0]] / SECONDS[0]) / (best[model, SECONDS[-1]] / SECONDS[-1]), 3)
             for model in MODELS}
    result = {"machine": machine(), "threads": 1, "config": CONFIG, "repeats": args.repeats,
              "command": f"python benchmarks/bench_w2v_attention.py --repeats {args.repeats}", "rows": rows,
              f"audio_seconds_per_second_{SECONDS[-1]}s_over_{SECONDS[0]}s": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = ["| chunk | frames | " + " | ".join(f"{model} ms / audio s" for model in MODELS) + " | ours vs stock |",
             "|---" * (len(MODELS) + 3) + "|"]
    table += [f"| {r['seconds']} s | {r['frames']} | "
              + " | ".join(str(r[f"{model}_ms_per_audio_second"]) for model in MODELS)
              + f" | {r['ours_vs_stock_relative_error']:.1e} |" for r in rows]
    table.append(f"| {SECONDS[-1]}-s / {SECONDS[0]}-s audio s/s | | "
                 + " | ".join(f"{ratio[model]}x" for model in MODELS) + " | |")
    text = "\n".join(table)
    print(result["machine"], "one thread")
    print(text)
    write_table(args.table, text)
    return 0


def write_table(path: Path | None, text: str) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


# the GPU mode's model: w2v-BERT 2.0's sizes to layer 17; --cpu-only: CONFIG's
GPU_CONFIG = {"hidden_size": 1024, "num_hidden_layers": 17, "num_attention_heads": 16, "intermediate_size": 4096,
              "position_embeddings_type": "relative_key", "left_max_position_embeddings": 64,
              "right_max_position_embeddings": 8}
# (rows, seconds) of each batch: about 640 s of audio a pass on a GPU, as the tools' passes hold
GPU_BATCHES = ((64, 10), (21, 30))
CPU_ONLY_BATCHES = ((2, 2), (1, 6))
NO_BIAS = "no bias"


def float32_errors(kernels: list[str], attention, device: torch.device, batch: tuple[int, int]) -> dict:
    """Each of our kernels on one layer's q, k, v in float32 (3 rows of `batch`'s length, the last half padded)
    against the gathered bias (exact SDPA with the bias in its mask): IEEE float32 products, no bfloat16."""
    from data.audio import w2v_attention as ours
    from data.audio.w2v_attention_triton import triton_relative_key_attention

    generator = torch.Generator(device=device).manual_seed(1)
    heads, head, length = attention.num_heads, attention.head_size, batch[1] * FRAME_RATE
    q, k, v = torch.randn(3, 3, heads, length, head, generator=generator, device=device)
    embedding = torch.randn(attention.left + attention.right + 1, head, generator=generator, device=device)
    valid = torch.ones(3, length, dtype=torch.bool, device=device)
    valid[-1, length // 2:] = False
    table = ours.distance_table(q, embedding, attention.scaling)
    shape = (attention.scaling, attention.left, attention.right)
    want = ours.gathered_relative_key_attention(q, k, v, table, valid, *shape)
    runs = {"fold": lambda: ours.folded_relative_key_attention(q, k, v, embedding, valid, *shape),
            "flex": lambda: ours.flex_relative_key_attention(q, k, v, embedding, valid, *shape),
            "triton": lambda: triton_relative_key_attention(q, k, v, table, valid, *shape)}
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return {kernel: float((runs[kernel]() - want).abs().max() / want.abs().max())
                for kernel in kernels if kernel in runs}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def by_kernel(args) -> int:
    """The GPU mode (or its --cpu-only check): the whole model's audio seconds per second with each kernel."""
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    from data.audio import w2v_attention_triton
    from data.audio.w2v_attention import compiled_flex_attention, use_fast_attention

    cpu_only = args.cpu_only
    if not cpu_only and not torch.cuda.is_available():
        print("no GPU visible: use --cpu-only", file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu_only else "cuda")
    dtype = torch.float32 if cpu_only else torch.bfloat16
    config = CONFIG if cpu_only else GPU_CONFIG
    batches = CPU_ONLY_BATCHES if cpu_only else GPU_BATCHES
    torch.manual_seed(0)
    with device:
        model = Wav2Vec2BertModel(Wav2Vec2BertConfig(**config)).eval()
        for layer in model.encoder.layers:  # the initialiser leaves the distance embeddings small: make them matter
            torch.nn.init.normal_(layer.self_attn.distance_embedding.weight, 0, 1.0)
        model = model.to(dtype)
    use_fast_attention(model)
    attentions = [layer.self_attn for layer in model.encoder.layers]
    kernels = ["stock"]
    if cpu_only:
        kernels.append("fold")
    elif compiled_flex_attention() is not None:
        kernels.append("flex")
    kernels.append("gather")
    tiles = {}
    if w2v_attention_triton.triton_available(device):
        kernels.append("triton")
        default = w2v_attention_triton.TILES[dtype == torch.float32]
        tiles["triton"] = default
        for text in filter(None, args.triton_tiles.split(",")):
            tile = tuple(int(n) for n in text.split("x"))
            if tile != default and not cpu_only:
                name = f"triton {tile[0]}x{tile[1]} w{tile[2]} s{tile[3]}"
                tiles[name] = tile
                kernels.append(name)
    kernels.append(NO_BIAS)

    def use(kernel: str) -> None:
        for attention in attentions:
            attention.kernel = kernel.split(" ")[0] if kernel != NO_BIAS else "stock"
            attention._stock[0].position_embeddings_type = None if kernel == NO_BIAS else "relative_key"
        if kernel in tiles:
            w2v_attention_triton.TILES[dtype == torch.float32] = tiles[kernel]

    generator = torch.Generator(device=device).manual_seed(0)
    inputs = {}
    for rows, seconds in batches:
        frames = seconds * FRAME_RATE
        x = torch.randn(rows, frames, 160, generator=generator, device=device).to(dtype)
        for padded in (False, True):
            mask = torch.ones(rows, frames, dtype=torch.long, device=device)
            if padded:
                mask[0, frames // 2:] = 0
            inputs[rows, seconds, padded] = (x * mask[..., None].to(dtype), mask, int(mask.sum()) / FRAME_RATE)

    def run(kernel, key):
        x, mask, _ = inputs[key]
        use(kernel)
        with torch.inference_mode():
            return model(input_features=x, attention_mask=mask).last_hidden_state

    def timed(kernel, key) -> float:
        use(kernel)
        times = []
        for _ in range(args.passes):
            if cpu_only:
                began = time.perf_counter()
                run(kernel, key)
                times.append(time.perf_counter() - began)
            else:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(kernel, key)
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
        return float(np.median(times))

    error, started = {}, time.perf_counter()
    for key in inputs:  # warm-up (compiles, autotuning, allocations) and each kernel's error against stock
        want = run("stock", key).float()
        for kernel in kernels:
            began = time.perf_counter()
            got = run(kernel, key).float()
            valid = inputs[key][1].bool()
            error[kernel, key] = float((got - want)[valid].abs().max() / want[valid].abs().max())
            if time.perf_counter() - began > 5:
                print(f"  warm-up {kernel} {key}: {time.perf_counter() - began:.1f} s", flush=True)
    print(f"warm-up {time.perf_counter() - started:.1f} s", flush=True)
    exact = float32_errors(kernels, attentions[0], device, batches[0])
    seconds = {(kernel, key): [] for kernel in kernels for key in inputs}
    for _ in range(args.rounds):
        for key in inputs:
            for kernel in kernels:
                seconds[kernel, key].append(timed(kernel, key))
    speed = {k: inputs[k[1]][2] / float(np.median(v)) for k, v in seconds.items()}
    use("triton" if "triton" in kernels else "stock")

    def label(key):
        rows, secs, padded = key
        return f"{rows} x {secs} s" + (", one row half padded" if padded else "")

    table = ["| attention | " + " | ".join(label(key) for key in inputs) + " |", "|---" + "|---:" * len(inputs) + "|"]
    for kernel in kernels:
        table.append(f"| {kernel} | " + " | ".join(f"{speed[kernel, key]:,.0f}" for key in inputs) + " |")
    for ratio_to in ("stock", NO_BIAS):
        for kernel in kernels:
            if kernel not in ("stock", NO_BIAS):
                table.append(f"| {kernel} / {ratio_to} | " + " | ".join(
                    f"{speed[kernel, key] / speed[ratio_to, key]:.2f}x" for key in inputs) + " |")
    table.append("")
    table.append("| largest error against stock | " + " | ".join(label(key) for key in inputs) + " |")
    table.append("|---" + "|---:" * len(inputs) + "|")
    for kernel in kernels:
        if kernel != "stock":
            table.append(f"| {kernel} | " + " | ".join(f"{error[kernel, key]:.1e}" for key in inputs) + " |")
    table.append("")
    table.append("| float32 attention, largest error against the gathered bias | " + " | ".join(exact) + " |")
    table.append("|---" + "|---:" * len(exact) + "|")
    table.append("| one layer, 3 rows, the last half padded | " + " | ".join(f"{e:.1e}" for e in exact.values()) + " |")
    text = "\n".join(table)
    command = "python benchmarks/bench_w2v_attention.py " + ("--cpu-only" if cpu_only else "--device cuda") + \
        f" --rounds {args.rounds} --passes {args.passes} --triton_tiles '{args.triton_tiles}'"
    result = {"machine": machine(), "device": str(device), "dtype": str(dtype).replace("torch.", ""),
              "config": config, "command": command,
              "figure": "audio seconds per second of the whole model (real frames / median pass time)",
              "rows": [{"kernel": kernel, "rows": key[0], "seconds": key[1], "padded": key[2],
                        "audio_seconds": inputs[key][2], "pass_seconds": seconds[kernel, key],
                        "audio_seconds_per_second": round(speed[kernel, key], 1),
                        "relative_error_against_stock": error[kernel, key]}
                       for kernel in kernels for key in inputs],
              "triton_tiles": {name: list(tile) for name, tile in tiles.items()},
              "float32_attention_error_against_gathered": exact}
    name = "bench_w2v_attention_cpu_only.json" if cpu_only else "bench_w2v_attention_gpu.json"
    out = args.out or REPO / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(result["machine"], result["dtype"])
    print(text)
    write_table(args.table, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
