"""Graph mode (data/audio/w2v_graphs.py): each pass padded to its shape's graph and replayed from fixed buffers. On this
CPU a capture is replaced by one that replays by running the pass again on the graph's buffers, so what is checked is
the data's way through them (copied in, computed, read out before the next replay), the padding, the planning and
that a pass asks the device for nothing (which a CUDA capture requires); the capture itself needs a GPU
(benchmarks/gpu_tokenize.sh runs the tools with --graphs on)."""
import numpy as np
import pytest
import torch

from benchmarks.host_ops_w2v import save_model, triton_launch_stubbed
from benchmarks.host_syncs import count_host_syncs
from data.audio.pass_plan import shard_passes, w2v_passes
from data.audio.w2v_graphs import GRAPH_FRAMES, GraphedPasses, padded_frames
from errors import BadInputError

pytestmark = pytest.mark.timeout(120)


def replaying_capture(run):
    """A capture for a CPU: `run` (which reads the graph's buffers) again at each replay, into the first output."""
    output = run()

    def replay():
        output.copy_(run())

    return replay, output


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("w2v"))


def layer(folder, **kwargs):
    from data.audio.features import W2vBertLayer

    encoder = W2vBertLayer(folder, 3, device=torch.device("cpu"), dtype=torch.float32, max_chunk_seconds=3.0,
                           **kwargs)
    encoder.use_attention("gather")
    return encoder


def fbanks(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 160, generator=generator) for n in lengths]


def test_graph_mode_needs_a_gpu_and_our_attention(model_folder):
    with pytest.raises(BadInputError, match="needs a GPU"):
        layer(model_folder, graphs=True)
    with pytest.raises(ValueError, match="not with compile or transformers' module"):
        layer(model_folder, graphs=True, attention="stock", graph_capture=replaying_capture)


def test_compile_on_a_gpu_is_refused_with_its_reason_before_anything_loads(model_folder):
    """--compile on must finish or be refused: its dynamic-shape compile did not finish on a GPU."""
    from data.audio.features import W2vBertLayer

    with pytest.raises(BadInputError, match="--compile on is refused on a GPU: .* did not finish .* --graphs on"):
        W2vBertLayer(model_folder, 3, device=torch.device("cuda"), dtype=torch.bfloat16, max_chunk_seconds=3.0,
                     compile=True)


def test_passes_are_planned_on_padded_lengths_and_a_shard_records_the_mode():
    lengths = np.array([10, 70, 64, 130, 129, 5], dtype=np.int64)
    assert list(padded_frames(lengths)) == [64, 128, 64, 192, 192, 64]
    budget = 2 * GRAPH_FRAMES / 50  # seconds: two padded chunks of 64 frames a pass
    graphed = w2v_passes(budget, graphs=True)(lengths)
    assert sorted(int(k) for p in graphed for k in p) == list(range(len(lengths)))
    for p in graphed:  # within the budget once padded
        assert len(p) * padded_frames(int(lengths[p].max())) <= 2 * GRAPH_FRAMES or len(p) == 1
    settings = {"batch_seconds": budget, "passes": "...", "graphs": "on"}
    assert [list(p) for p in shard_passes(settings)(lengths)] == [list(p) for p in graphed]
    plain = shard_passes({"batch_seconds": budget, "passes": "..."})(lengths)
    assert [list(p) for p in plain] != [list(p) for p in graphed]  # 3 chunks of 64, 10 and 5 frames fit unpadded


def test_a_window_through_the_graphs_equals_the_eager_passes_and_replays_without_new_captures(model_folder):
    eager = layer(model_folder)
    graphed = layer(model_folder, graphs=True, graph_capture=replaying_capture)
    files = fbanks([100, 260, 37, 150, 90, 301, 64])
    plan = w2v_passes(4.0, graphs=True)
    want = eager.encode(files, plan)
    got = graphed.encode(files, plan)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the padding to the graph's shape is masked
    shapes = graphed.graphed.captures
    assert shapes == len(graphed.graphed.graphs) >= 2
    again = graphed.encode(files, plan)  # every shape met: replays only, the same bits
    assert graphed.graphed.captures == shapes
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    other = fbanks([100, 260, 37, 150, 90, 301, 64], seed=1)  # new inputs through the same graphs
    torch.testing.assert_close(graphed.encode(other, plan), eager.encode(other, plan), rtol=1e-5, atol=1e-5)
    assert graphed.graphed.captures == shapes


def test_the_least_recently_used_graph_is_dropped_past_the_limit():
    calls = []

    def run(x, mask):
        calls.append(tuple(mask.shape))
        return x * 2

    passes = GraphedPasses(run, replaying_capture, limit=2)
    for rows, frames in ((1, 64), (2, 64), (1, 64), (3, 128)):
        x = torch.full((rows, frames, 1), float(rows))
        torch.testing.assert_close(passes(x, torch.ones(rows, frames)), x * 2)
    assert list(passes.graphs) == [(1, 64), (3, 128)] and passes.captures == 3


@pytest.mark.parametrize("kernel", ["gather", "triton"])
def test_a_graph_mode_pass_asks_the_device_for_nothing(model_folder, kernel):
    """A CUDA capture fails on a host sync or a value read back: none in a padded pass of our kernels."""
    encoder = layer(model_folder, graphs=True, graph_capture=replaying_capture)
    encoder.use_attention(kernel)
    x = torch.randn(3, 2 * GRAPH_FRAMES, 160)
    mask = (torch.arange(2 * GRAPH_FRAMES) < torch.tensor([[128], [100], [7]])).long()
    with triton_launch_stubbed(), torch.inference_mode():  # as GraphedPasses runs it
        encoder._layer_output(x, mask)
        with count_host_syncs(count_ops=True) as counter:
            encoder._layer_output(x, mask)
    assert counter.total == 0, dict(counter.by_caller)
