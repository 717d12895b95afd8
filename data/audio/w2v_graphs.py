"""w2v-BERT's forward passes replayed from CUDA graphs: one capture per pass shape, then one launch a pass.

On a GPU the tools' passes are bound by the host: each layer is some 57 ops, each a kernel launch from Python
(benchmarks/host_ops_w2v.py), and the device waits between them. A CUDA graph records a pass's kernels once and
replays them all in one call. A graph holds one shape, so in graph mode (tools' --graphs on) every chunk of a pass
is padded to a multiple of GRAPH_FRAMES frames (masked as any padding is; data/audio/pass_plan.py plans the passes on
those lengths) and a graph is captured for each (rows, frames) met, the first time it is met: one eager pass to
warm up (lazy initialisations, Triton's compile), then the capture. The graphs share one memory pool; the
GRAPH_LIMIT most recently used are kept.

What a capture needs of the pass: no host sync and no value read back (data/audio/w2v_attention.py hands our attention
its padding mask as it is; transformers' own module reads the mask back and cannot be captured), and inputs in
fixed buffers: each replay copies the pass's input and mask into the graph's own, and its output is the graph's
own buffer, valid until the next replay of any graph (the graphs share their pool: the caller copies it out
first, on the same stream). A capture forbids unsafe CUDA calls on the capturing thread only: the writer thread
waits on its copies meanwhile.

Padding a chunk changes the last bits of its layer outputs (other shapes, other kernels' tilings), and so may a
graph against the same pass run eagerly: a shard records graph mode with its passes (tools/audio_shard.py
pass_settings) and goes on in the mode it was begun in."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch

GRAPH_FRAMES = 64  # a chunk is padded to a multiple of this many frames (1.28 s) in graph mode
GRAPH_LIMIT = 64  # graphs kept, the most recently used; another shape's capture drops the oldest

# capture(run) -> (replay, output): `run()` recorded so that `replay()` computes it again into `output`
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def padded_frames(frames: int) -> int:
    """A pass's frames in graph mode: `frames` up to the next multiple of GRAPH_FRAMES."""
    return -(-frames // GRAPH_FRAMES) * GRAPH_FRAMES


class CudaCapture:
    """Capture on the current CUDA device, every graph in one memory pool (a pass's intermediates are reused by the
    next shape's capture, and its output may be another graph's intermediate: the graphs replay one at a time, on one
    stream, and each output is read before the next replay)."""

    def __init__(self):
        self.pool = None

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up, off the capture: lazy initialisations, Triton's compile
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = run()
        return graph.replay, output


class GraphedPasses:
    """`run(x, mask) -> output` (a pass of the model, [rows, frames, 160] input and [rows, frames] mask on the
    device) replayed from a graph per (rows, frames): `passes(x, mask)` gives the graph's output buffer. `captures`
    counts the graphs captured and `capture_seconds` their time (start-up work, not a pass's)."""

    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], capture: Capture | None = None,
                 limit: int = GRAPH_LIMIT):
        self.run, self.capture, self.limit = run, capture if capture is not None else CudaCapture(), limit
        self.graphs: OrderedDict = OrderedDict()  # (rows, frames) -> (replay, x buffer, mask buffer, output)
        self.captures, self.capture_seconds = 0, 0.0

    def __call__(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        key = tuple(mask.shape)
        with torch.inference_mode():
            if key in self.graphs:
                self.graphs.move_to_end(key)
                replay, x_buffer, mask_buffer, output = self.graphs[key]
                x_buffer.copy_(x)
                mask_buffer.copy_(mask)
                replay()
                return output
            began = time.perf_counter()
            x_buffer, mask_buffer = x.clone(), mask.clone()
            replay, output = self.capture(lambda: self.run(x_buffer, mask_buffer))
            self.graphs[key] = (replay, x_buffer, mask_buffer, output)
            while len(self.graphs) > self.limit:
                self.graphs.popitem(last=False)
            self.captures += 1
            replay()  # a capture records without computing
            self.capture_seconds += time.perf_counter() - began
            return output
