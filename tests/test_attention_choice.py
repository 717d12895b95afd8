"""data/audio/attention_choice.py: the attention kernel chosen by measurement, never one that failed its probe, and
cached so that the next process computes with the same one."""
import json
import logging

import pytest
import torch

from data.audio import attention_choice, w2v_attention
from data.audio.attention_choice import Choice, choose_kernel, pass_shapes
from data.audio.features import W2vBertLayer
from tests.audio_helpers import tiny_w2v_bert

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:flex_attention called without")]

SHAPES = [(3, 60, False), (3, 60, True), (5, 20, False)]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    folder = tiny_w2v_bert(tmp_path_factory.mktemp("w2v"))
    return W2vBertLayer(folder, 2, device=torch.device("cpu"), dtype=torch.float32, max_chunk_seconds=2.0)


def fake_timer(seconds: dict, calls: list):
    def timer(encoder, kernel, inputs):
        calls.append(kernel)
        return seconds[kernel]
    return timer


def test_the_fastest_kernel_that_agrees_is_chosen_and_one_that_fails_its_probe_never(encoder, tmp_path,
                                                                                    monkeypatch):
    flex = w2v_attention.flex_relative_key_attention
    monkeypatch.setattr(w2v_attention, "flex_relative_key_attention", lambda *a, **k: flex(*a, **k) * 1.01)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton cannot run on this CPU
    calls = []
    # flex is the fastest on the clock, but its outputs are 1% off: left out, as triton (not here) is
    choice = choose_kernel(encoder, SHAPES, path=tmp_path / "cache.json",
                           timer=fake_timer({"stock": 3.0, "gather": 2.0, "flex": 0.5, "triton": 0.1}, calls))
    assert choice.kernel == "gather" and not choice.cached
    assert sorted(calls) == ["gather", "stock"]
    assert set(choice.failed) == {"flex", "triton"}
    assert "differ from the gathered bias by 1.0e-02" in choice.failed["flex"]
    assert "Triton runs on CUDA" in choice.failed["triton"]
    assert choice.describe().startswith("gather (one layer's attention over the run's pass shapes: gather 2000.00 "
                                        "ms, stock 3000.00 ms; triton left out: Triton runs on CUDA")
    assert encoder.attention == "auto"  # measuring leaves the encoder as it was


def test_a_kernel_that_raises_is_left_out_with_its_reason(encoder, tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(w2v_attention, "flex_relative_key_attention", failing)
    choice = choose_kernel(encoder, SHAPES, path=tmp_path / "cache.json",
                           timer=fake_timer({"stock": 1.0, "gather": 2.0}, []))
    assert choice.kernel == "stock"  # transformers' own is a candidate: never slower than stock
    assert choice.failed["flex"] == "RuntimeError: out of resources: shared memory"


def test_the_choice_is_cached_per_device_dtype_torch_and_shapes(encoder, tmp_path, monkeypatch):
    path = tmp_path / "cache.json"
    calls = []
    monkeypatch.setattr(attention_choice, "GPU_CANDIDATES", ("stock", "gather"))
    first = choose_kernel(encoder, SHAPES, path=path, timer=fake_timer({"stock": 1.0, "gather": 2.0}, calls))
    again = choose_kernel(encoder, SHAPES, path=path, timer=fake_timer({}, calls))  # a second process: no timing
    assert (first.kernel, first.cached, again.kernel, again.cached) == ("stock", False, "stock", True)
    assert again.seconds == first.seconds and calls == ["stock", "gather"]
    entries = json.loads(path.read_text())
    key, = entries
    assert key.startswith(f"cpu | float32 | torch {torch.__version__} | 2 heads of 16, left 64 right 8 | passes ")
    other = choose_kernel(encoder, SHAPES[:1], path=path, timer=fake_timer({"stock": 2.0, "gather": 1.0}, calls))
    assert other.kernel == "gather" and not other.cached and len(json.loads(path.read_text())) == 2
    path.write_text("{not json")  # a damaged cache is measured again and rewritten
    assert choose_kernel(encoder, SHAPES, path=path, timer=fake_timer({"stock": 1.0, "gather": 2.0}, [])).kernel \
        == "stock"
    assert len(json.loads(path.read_text())) == 1


def test_the_real_timer_times_every_shape(encoder, tmp_path, monkeypatch):
    monkeypatch.setattr(attention_choice, "GPU_CANDIDATES", ("stock", "gather"))
    monkeypatch.setattr(attention_choice, "TIMED_PASSES", 2)
    choice = choose_kernel(encoder, SHAPES, path=tmp_path / "cache.json")
    assert set(choice.seconds) == {"stock", "gather"} and all(s > 0 for s in choice.seconds.values())


def test_the_run_s_pass_shapes():
    # the tools' GPU default: 600 s of padded audio a pass, chunks of 30 s at most (50 frames a second)
    assert pass_shapes(30_000, 1500) == [(20, 1500, False), (20, 1500, True), (60, 500, False), (60, 500, True)]
    assert pass_shapes(100, 1500) == [(1, 1500, False), (1, 1500, True), (1, 500, False), (1, 500, True)]
    assert pass_shapes(3000, 2) == [(1500, 2, False), (1500, 2, True), (3000, 1, False), (3000, 1, True)]


def test_a_kernel_that_cannot_run_here_says_why(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attention_choice.unavailable("stock", cpu) is None and attention_choice.unavailable("gather", cuda) is None
    assert attention_choice.unavailable("fold", cuda) == "it runs on a CPU only"
    assert "Triton runs on CUDA" in attention_choice.unavailable("triton", cpu)
    assert attention_choice.unavailable("fold", cpu) is None and attention_choice.cpu_kernel() == "fold"
    monkeypatch.setattr(w2v_attention, "_cpu_attention_with_lse", lambda: None)
    assert attention_choice.cpu_kernel() == "gather" and "log-sum-exp" in attention_choice.unavailable("fold", cpu)


def test_the_log_line_names_every_timing(caplog):
    caplog.set_level(logging.INFO)
    text = Choice("triton", {"stock": 0.017, "triton": 0.0064}, {"flex": "failed"}).describe()
    assert text == "triton (one layer's attention over the run's pass shapes: triton 6.40 ms, stock 17.00 ms; " \
                   "flex left out: failed)"


def test_a_padded_shape_times_the_padded_mask(encoder):
    args, kwargs = attention_choice.attention_inputs(encoder, (3, 60, True))
    valid = w2v_attention.key_padding(kwargs["attention_mask"], 3, 60)
    assert valid.sum(dim=1).tolist() == [60, 60, 30]
    args, kwargs = attention_choice.attention_inputs(encoder, (3, 60, False))
    mask = kwargs.get("attention_mask")
    assert mask is None or bool(w2v_attention.key_padding(mask, 3, 60).all())


def test_a_home_without_a_cache_still_chooses(encoder, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(attention_choice, "GPU_CANDIDATES", ("stock", "gather"))
    blocked = tmp_path / "file"
    blocked.write_text("")
    choice = choose_kernel(encoder, SHAPES, path=blocked / "cache" / "kernels.json",
                           timer=fake_timer({"stock": 2.0, "gather": 1.0}, []))
    assert choice.kernel == "gather" and not choice.cached
    assert "cannot be cached" in caplog.text


def test_nothing_to_check_against_keeps_transformers_attention(encoder, tmp_path, monkeypatch, caplog):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.40 GiB")

    monkeypatch.setattr(w2v_attention, "gathered_relative_key_attention", out_of_memory)
    choice = choose_kernel(encoder, SHAPES, path=tmp_path / "cache.json", timer=fake_timer({}, []))
    assert choice.kernel == "stock" and "out of memory" in choice.failed["gather"]
    assert "keeps transformers' attention" in caplog.text
