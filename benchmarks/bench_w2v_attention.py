"""w2v-BERT's relative-position attention on one CPU thread: transformers' module against ours
(data/w2v_attention.py), by chunk length.

A random Wav2Vec2BertModel with w2v-BERT 2.0's positions (relative_key, left 64, right 8), 4 layers of hidden 256
(intermediate 1024, 4 heads; the other fields at Wav2Vec2BertConfig's defaults), saved and loaded through
data/audio_features.py's W2vBertLayer (layer 4), runs one chunk per forward pass of 5, 10, 20 and 30 s (50 frames
a second). Four models, timed interleaved, best of --repeats:
- stock: transformers' attention (a [T, T, head_dim] table, a [B, H, T, T] bias);
- ours: RelativeKeySelfAttention as a CPU runs it: per block of queries, the near keys' bias gathered from a
  [B, H, T, 73] table, the far keys' bias folded into the keys;
- gathered: ours with the bias of every key gathered into SDPA's mask (its fallback kernel);
- unbiased: ours with the bias left out: not w2v-BERT, the cost of the same model's attention without positions,
  so ours - unbiased is what the bias still costs and unbiased itself what attention's T^2 work leaves.
Figures: ms of model time per audio second (the forward pass's CPU time on its one thread, which a busy machine
inflates less than wall time), and each model's audio seconds per second on 30-s chunks as a share of that on
5-s chunks.

    python benchmarks/bench_w2v_attention.py [--repeats 7] [--out benchmarks/results/bench_w2v_attention.json]
                                             [--table /tmp/figs/attention.md]
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
from data.audio_features import FRAME_RATE, W2vBertLayer  # noqa: E402
from data.w2v_attention import RelativeKeySelfAttention, key_padding  # noqa: E402

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
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_w2v_attention.json")
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
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
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
