"""The host's work in one w2v-BERT forward pass of the tools (data/audio/features.py W2vBertLayer.hidden), by
attention kernel: the ops it dispatches, a pass's and each layer's, and its host synchronisations by the source line
that asks for them, counted on any device (benchmarks/host_syncs.py's counter: each op is host work, on a GPU most
are a kernel launch, and each sync drains the GPU's queue before the host can launch more).

A small random model with w2v-BERT 2.0's positions (relative_key, left 64, right 8), run at 2 and at 4 layers: the
difference is 2 layers' ops, the rest is the pass's own (the feature projection, the mask, the copy in). Each
kernel runs a pass of 3 chunks of 120 frames (no padding) and one of 120, 100 and 60 (padded). Then a window as
tools.extract feeds it on a GPU (W2vBertLayer.encode over fbanks already on the device, here the CPU's tensors), in
one padded pass of 2 files and one of 8: the ops of the pass beyond its layers, whose difference is what each row
adds (the gather of its input and the scatter of its output). The Triton kernel's
launch is stubbed out where Triton cannot run (a CPU): what is counted is the host's work around it, the same as
on a GPU.

    python benchmarks/host_ops_w2v.py [--out benchmarks/results/host_ops_w2v.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.host_syncs import count_host_syncs  # noqa: E402

CONFIG = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128,
          "output_hidden_size": 64, "feature_projection_input_dim": 160, "conv_depthwise_kernel_size": 5,
          "position_embeddings_type": "relative_key", "left_max_position_embeddings": 64,
          "right_max_position_embeddings": 8}
KERNELS = ("triton", "stock", "gather", "fold")
PASSES = {"unpadded": (120, 120, 120), "padded": (120, 100, 60)}


@contextlib.contextmanager
def triton_launch_stubbed():
    """The Triton kernel's launch as a no-op where Triton cannot run here, so that the host's work around it is
    counted."""
    from data.audio import w2v_attention_triton as triton_module

    if triton_module.triton_available(torch.device("cpu")) or triton_module.triton is None:
        yield
        return

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    kernel = triton_module._relative_key_attention
    triton_module._relative_key_attention = NoLaunch()
    try:
        yield
    finally:
        triton_module._relative_key_attention = kernel


def save_model(folder: Path) -> Path:
    """The small random model of CONFIG (seed 0), saved in `folder` as transformers saves one."""
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    torch.manual_seed(0)
    Wav2Vec2BertModel(Wav2Vec2BertConfig(**CONFIG)).eval().save_pretrained(folder)
    return folder


def pass_counts(encoder, lengths) -> tuple[int, dict]:
    """(ops dispatched, host syncs by the line asking) of one pass of chunks of `lengths` frames, after one
    untimed pass of the same (first-use work aside)."""
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal((n, 160)).astype(np.float32) for n in lengths]
    encoder.hidden(chunks)
    with count_host_syncs(count_ops=True) as counter:
        encoder.hidden(chunks)
    return sum(counter.ops_by_owner.values()), dict(counter.by_caller)


WINDOW_ROWS = (2, 8)  # files of a window in its one pass


def window_counts(encoder, rows: int) -> int:
    """Ops dispatched by encode of a window of `rows` files of fbank tensors (every other one shorter: the pass is
    padded) in one pass, after one untimed run of the same."""
    torch.manual_seed(0)
    fbanks = [torch.randn(120 if i % 2 else 100, 160) for i in range(rows)]

    def one_pass(lengths):
        return [np.arange(len(lengths))]

    encoder.encode(fbanks, one_pass)
    with count_host_syncs(count_ops=True) as counter:
        encoder.encode(fbanks, one_pass)
    return sum(counter.ops_by_owner.values())


def measure_window(folder: Path) -> dict:
    """The ops of encode's one pass over a window of WINDOW_ROWS files, beyond its layers (at 2 layers, less 2
    layers' ops of the same pass through hidden alone), and what each row adds."""
    from data.audio.features import W2vBertLayer

    encoders = {layers: W2vBertLayer(folder, layers, device=torch.device("cpu"), dtype=torch.float32,
                                     max_chunk_seconds=5.0) for layers in (2, 4)}
    with triton_launch_stubbed():
        for encoder in encoders.values():
            encoder.use_attention("triton")
        ops = {}
        for rows in WINDOW_ROWS:  # at 2 layers, less 2 layers' ops (the 4-layer count's excess)
            two, four = window_counts(encoders[2], rows), window_counts(encoders[4], rows)
            ops[rows] = two - (four - two)
    low, high = WINDOW_ROWS
    return {"kernel": "triton", "ops_beyond_the_layers": ops, "ops_per_row": (ops[high] - ops[low]) / (high - low)}


def measure(folder: Path) -> list[dict]:
    """A row per kernel and pass: the pass's ops, each layer's, the pass's own, its syncs (by line)."""
    from data.audio.features import W2vBertLayer

    rows = []
    encoders = {layers: W2vBertLayer(folder, layers, device=torch.device("cpu"), dtype=torch.float32,
                                     max_chunk_seconds=5.0) for layers in (2, 4)}
    with triton_launch_stubbed():
        for kernel in KERNELS:
            for name, lengths in PASSES.items():
                counts = {}
                for layers, encoder in encoders.items():
                    encoder.use_attention(kernel)
                    counts[layers] = pass_counts(encoder, lengths)
                per_layer = (counts[4][0] - counts[2][0]) / 2
                rows.append({"kernel": kernel, "pass": name, "ops_per_pass_4_layers": counts[4][0],
                             "ops_per_layer": per_layer, "ops_of_the_pass_itself": counts[2][0] - 2 * per_layer,
                             "syncs_per_pass": sum(counts[4][1].values()), "syncs_by_line": counts[4][1]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "host_ops_w2v.json")
    args = parser.parse_args(argv)
    from benchmarks.demo_run import machine

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        folder = save_model(Path(folder))
        rows = measure(folder)
        window = measure_window(folder)
    result = {"machine": machine(), "config": CONFIG, "passes": PASSES, "rows": rows, "window": window,
              "command": "python benchmarks/host_ops_w2v.py"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| kernel | pass | ops a layer | ops of the pass itself | host syncs a pass (where) |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        where = "; ".join(f"{line.split('/')[-1]} x{n}" for line, n in r["syncs_by_line"].items()) or "none"
        print(f"| {r['kernel']} | {r['pass']} | {r['ops_per_layer']:.0f} | {r['ops_of_the_pass_itself']:.0f} | "
              f"{r['syncs_per_pass']} ({where}) |")
    print("\nencode, one padded pass of a window (triton): ops beyond the layers "
          + ", ".join(f"{n} at {rows} rows" for rows, n in window["ops_beyond_the_layers"].items())
          + f"; {window['ops_per_row']:.1f} ops a row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
