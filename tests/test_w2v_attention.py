"""data/audio/w2v_attention.py: w2v-BERT's relative-position attention without a T x T table equals transformers'
one."""
import copy
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from data.audio import w2v_attention
from data.audio.w2v_attention import KEY_PADDING, RelativeKeySelfAttention, key_padding, use_fast_attention
from tests.helpers import REPO, env

pytestmark = pytest.mark.timeout(120)


def tiny_config(**overrides):
    from transformers import Wav2Vec2BertConfig

    fields = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 128,
              "output_hidden_size": 64, "feature_projection_input_dim": 160, "conv_depthwise_kernel_size": 5,
              "position_embeddings_type": "relative_key", "left_max_position_embeddings": 64,
              "right_max_position_embeddings": 8}
    return Wav2Vec2BertConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def stock_model():
    from transformers import Wav2Vec2BertModel

    torch.manual_seed(0)
    model = Wav2Vec2BertModel(tiny_config()).eval()
    with torch.no_grad():  # the initialiser leaves the distance embeddings small; make the bias matter
        for layer in model.encoder.layers:
            layer.self_attn.distance_embedding.weight.normal_(0, 1.0)
    return model


def fast_copy(model, kernel="auto"):
    fast = copy.deepcopy(model)
    assert use_fast_attention(fast, kernel=kernel) == len(fast.encoder.layers)
    assert all(isinstance(layer.self_attn, RelativeKeySelfAttention) for layer in fast.encoder.layers)
    return fast


def padded_batch(length, dtype=torch.float32):
    """Three rows of `length`, `length` - 17 and `length` // 2 frames, and their attention mask."""
    generator = torch.Generator().manual_seed(length)
    x = torch.randn(3, length, 160, generator=generator)
    mask = torch.zeros(3, length, dtype=torch.long)
    for row, n in enumerate((length, length - 17, length // 2)):
        mask[row, :n] = 1
        x[row, n:] = 0
    return x.to(dtype), mask


def hidden_states(model, x, mask):
    with torch.inference_mode():
        return model(input_features=x, attention_mask=mask, output_hidden_states=True).hidden_states


_STOCK = {}


def stock_hidden_states(model, length):
    """The stock model's hidden states on padded_batch(length), computed once per length."""
    if length not in _STOCK:
        _STOCK[length] = hidden_states(model, *padded_batch(length))
    return _STOCK[length]


def relative_error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("kernel, length", [("auto", 40), ("auto", 300), ("gather", 300)])  # 73 distances
def test_every_layer_equals_the_stock_model_in_float32_with_padding(stock_model, kernel, length):
    fast = fast_copy(stock_model, kernel)
    x, mask = padded_batch(length)
    want, got = stock_hidden_states(stock_model, length), hidden_states(fast, x, mask)
    assert len(got) == len(want) == 4
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert relative_error(g, w) < 1e-5, f"layer {layer}"
    # without a mask too (no padding), and a row alone equals its padded row's valid frames
    alone = hidden_states(fast, x[1:2, : length - 17], None)[-1][0]
    np.testing.assert_allclose(alone.numpy(), got[-1][1, : length - 17].numpy(), rtol=1e-4, atol=1e-4)


def test_a_cpu_takes_the_folded_kernel(stock_model, monkeypatch):
    attention = fast_copy(stock_model).encoder.layers[0].self_attn
    assert attention._kernel(torch.zeros(1, device="cpu"), 0.0) == "fold"
    assert attention._kernel(torch.zeros(1, device="cpu"), 0.1) == "gather"  # attention dropout, in training
    monkeypatch.setattr(w2v_attention, "_cpu_attention_with_lse", lambda: None)  # a torch without the LSE kernel
    assert attention._kernel(torch.zeros(1, device="cpu"), 0.0) == "gather"


def test_the_bias_changes_the_output(stock_model):
    """The comparison above can fail: a bias read at the mirrored distance is off by far more than 1e-5."""
    fast = fast_copy(stock_model)
    x, mask = padded_batch(120)
    want = stock_hidden_states(stock_model, 120)[-1]
    for layer in fast.encoder.layers:  # swap left and right: distance d read as -d
        attention = layer.self_attn
        attention.left, attention.right = attention.right, attention.left
    assert relative_error(hidden_states(fast, x, mask)[-1], want) > 1e-3


@pytest.mark.parametrize("kernel", ["fold", "gather"])
def test_small_blocks_of_queries_give_the_same_numbers(stock_model, monkeypatch, kernel):
    fast = fast_copy(stock_model, kernel)
    x, mask = padded_batch(170)
    whole = hidden_states(fast, x, mask)[-1]
    monkeypatch.setitem(w2v_attention.folded_relative_key_attention.__kwdefaults__, "rows", 16)
    monkeypatch.setattr(w2v_attention, "MIN_BLOCK_ROWS", 16)
    monkeypatch.setitem(w2v_attention.gathered_relative_key_attention.__kwdefaults__, "block_bytes", 1)
    blocks = hidden_states(fast, x, mask)[-1]  # 11 blocks of 16 queries, the last of 10
    assert relative_error(blocks, whole) < 1e-5


@pytest.mark.parametrize("kernel", ["fold", "gather"])
def test_bfloat16_error_is_within_the_stock_models_own(stock_model, kernel):
    fast = fast_copy(stock_model, kernel)
    x, mask = padded_batch(300)
    reference = stock_hidden_states(stock_model, 300)[-1]
    if "bfloat16" not in _STOCK:
        _STOCK["bfloat16"] = hidden_states(copy.deepcopy(stock_model).bfloat16(), x.bfloat16(), mask)[-1]
    stock_error = relative_error(_STOCK["bfloat16"], reference)
    fast_error = relative_error(hidden_states(fast.bfloat16(), x.bfloat16(), mask)[-1], reference)
    print(f"bfloat16 relative error: stock {stock_error:.2e}, {kernel} {fast_error:.2e}")
    assert 0 < stock_error < 0.1
    assert fast_error <= 1.25 * stock_error, (fast_error, stock_error)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_score_mod_equals_the_stock_model(stock_model):
    pytest.importorskip("torch.nn.attention.flex_attention")
    fast = fast_copy(stock_model, kernel="flex")
    x, mask = padded_batch(100)
    want = stock_hidden_states(stock_model, 100)
    try:
        got = hidden_states(fast, x, mask)
    except (RuntimeError, NotImplementedError) as e:  # a torch whose flex attention has no eager CPU path
        pytest.skip(f"flex attention does not run eagerly on this CPU: {e}")
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert relative_error(g, w) < 1e-5, f"layer {layer}"


def test_padding_masks_of_every_form_give_the_same_keys():
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    want = valid.bool()
    boolean = want[:, None, None, :].expand(2, 1, 4, 4)  # transformers 5
    additive = (1.0 - valid[:, None, None, :].float()) * torch.finfo(torch.float32).min  # transformers 4.x
    for mask in (valid, boolean, additive.expand(2, 1, 4, 4), additive.bfloat16()):
        assert torch.equal(key_padding(mask, 2, 4), want)
    assert key_padding(None, 2, 4) is None


def test_other_position_types_keep_the_stock_module():
    from transformers import Wav2Vec2BertModel

    for kind in ("rotary", "relative", None):
        model = Wav2Vec2BertModel(tiny_config(position_embeddings_type=kind, num_hidden_layers=1))
        before = model.encoder.layers[0].self_attn
        assert use_fast_attention(model) == 0 and model.encoder.layers[0].self_attn is before


def test_w2v_bert_layer_fast_and_stock_attention_agree(tmp_path, stock_model, caplog):
    from data.audio.features import W2vBertLayer

    stock_model.save_pretrained(tmp_path)
    chunks = [np.random.default_rng(n).standard_normal((n, 160)).astype(np.float32) for n in (250, 180, 90)]
    layers = {kind: W2vBertLayer(tmp_path, 2, device=torch.device("cpu"), dtype=torch.float32,
                                 max_chunk_seconds=5.0, attention=kind) for kind in ("fast", "stock")}
    assert isinstance(layers["fast"].model.encoder.layers[1].self_attn, RelativeKeySelfAttention)
    assert not isinstance(layers["stock"].model.encoder.layers[1].self_attn, RelativeKeySelfAttention)
    assert layers["fast"].model.state_dict().keys() == layers["stock"].model.state_dict().keys()
    for got, want in zip(layers["fast"].forward(chunks), layers["stock"].forward(chunks), strict=True):
        assert got.shape == want.shape
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    # the encoder hands our layers the [B, T] padding mask as it is; transformers' module, chosen among ours, gets
    # the mask transformers builds from it, and computes the bits of the untouched model
    assert layers["fast"].model.encoder.config._attn_implementation == KEY_PADDING
    assert layers["stock"].model.encoder.config._attn_implementation != KEY_PADDING
    layers["fast"].use_attention("stock")
    for got, want in zip(layers["fast"].forward(chunks), layers["stock"].forward(chunks), strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="'fast' or 'stock'"):
        W2vBertLayer(tmp_path, 2, device=torch.device("cpu"), dtype=torch.float32, max_chunk_seconds=5.0,
                     attention="flash")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.slow
def test_w2v_bert_layer_compiled_equals_eager_and_counts_its_graphs(tmp_path, stock_model, caplog):
    """--compile: the truncated encoder under torch.compile gives eager's layer output; the graphs it compiles are
    counted and logged, and a pass of a shape already compiled compiles nothing more."""
    from data.audio.features import W2vBertLayer

    stock_model.save_pretrained(tmp_path)
    layers = {compiled: W2vBertLayer(tmp_path, 1, device=torch.device("cpu"), dtype=torch.float32,
                                     max_chunk_seconds=5.0, compile=compiled) for compiled in (False, True)}
    caplog.set_level(logging.INFO, logger="data.audio.features")
    rng = np.random.default_rng(0)
    for lengths in ((120, 100, 60), (120, 80, 40)):  # one pass shape, 3 x 120, with other paddings
        chunks = [rng.standard_normal((n, 160)).astype(np.float32) for n in lengths]
        for got, want in zip(layers[True].forward(chunks), layers[False].forward(chunks), strict=True):
            assert got.shape == want.shape
            assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    assert layers[True].graphs == 1 and layers[False].graphs == 0
    assert [r.getMessage().split(" (")[0] for r in caplog.records if "compiled graph" in r.getMessage()] == \
        ["w2v-bert: compiled graph 1, for a pass of 3 x 120 frames"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_kernel_is_proven_before_use_and_given_up_when_wrong_or_failing(monkeypatch, caplog):
    """A flex kernel is used only after a probe of the shapes later passes compile agrees with the gathered bias;
    a kernel that fails or computes something else is given up for the process, with a warning."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    q = torch.randn(2, 4, 50, 16)
    embedding = torch.randn(64 + 8 + 1, 16)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[:3])
        return flex(*args, **kwargs)

    monkeypatch.setitem(w2v_attention._FLEX_STATE, "proven", set())
    monkeypatch.setitem(w2v_attention._FLEX_STATE, "failed", False)
    try:
        assert w2v_attention.flex_proven(counted, q, embedding, True, 0.25, 64, 8)
    except (RuntimeError, NotImplementedError) as e:  # a torch whose flex attention has no eager CPU path
        pytest.skip(f"flex attention does not run eagerly on this CPU: {e}")
    assert calls == [(rows, 4, frames) for rows, frames in w2v_attention.PROBE_SHAPES]
    assert w2v_attention.flex_proven(counted, q, embedding, True, 0.25, 64, 8) and len(calls) == 3  # once a layout

    def wrong(*args, **kwargs):
        return flex(*args, **kwargs) * 1.1

    def failing(*args, **kwargs):
        raise RuntimeError("triton compilation failed")

    for kernel, says in ((wrong, "differ from the gathered bias"), (failing, "triton compilation failed")):
        monkeypatch.setitem(w2v_attention._FLEX_STATE, "failed", False)
        monkeypatch.setitem(w2v_attention._FLEX_STATE, "proven", set())
        caplog.clear()
        assert not w2v_attention.flex_proven(kernel, q, embedding, True, 0.25, 64, 8)
        assert w2v_attention._FLEX_STATE["failed"] and w2v_attention.compiled_flex_attention() is None
        assert [r for r in caplog.records if r.levelno == logging.WARNING and says in r.getMessage()]


# Run under TRITON_INTERPRET=1 in a process of its own (Triton reads it when a kernel is defined): the Triton kernel
# and the stock model on the same weights, the largest error relative to the stock model's largest value, per case.
TRITON_CASES = r"""
import json, sys
import torch
from tests.test_w2v_attention import fast_copy, hidden_states, padded_batch, relative_error, tiny_config
from transformers import Wav2Vec2BertModel

errors = {}
cases = [tuple(map(int, case.split(":"))) for case in sys.argv[1:]]  # hidden:heads:frames
for hidden, heads in sorted({case[:2] for case in cases}):
    torch.manual_seed(0)
    stock = Wav2Vec2BertModel(tiny_config(hidden_size=hidden, num_attention_heads=heads, output_hidden_size=hidden,
                                          num_hidden_layers=2)).eval()  # 2: the second reuses the pass's keys
    with torch.no_grad():
        for layer in stock.encoder.layers:
            layer.self_attn.distance_embedding.weight.normal_(0, 1.0)
    fast = fast_copy(stock, "triton")
    for length in [frames for h, n, frames in cases if (h, n) == (hidden, heads)]:
        x, mask = padded_batch(length)
        for padded in (True, False):
            want = hidden_states(stock, x, mask if padded else None)
            got = hidden_states(fast, x, mask if padded else None)
            errors[f"head {hidden // heads}, {length} frames, padded {padded}"] = max(
                relative_error(g, w) for g, w in zip(got, want, strict=True))
print(json.dumps(errors))
"""


@pytest.mark.slow
def test_the_triton_kernel_equals_the_stock_model_in_float32_with_and_without_padding():
    """The Triton kernel (data/audio/w2v_attention_triton.py) as Triton's interpreter runs it on this CPU: every layer
    within 1e-5 of transformers' module, at lengths shorter than a tile, not a multiple of it, and spanning the
    band's left and right ends in several tiles; heads of 16, and of 24 (padded to 32 inside the kernel)."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", TRITON_CASES, "64:4:40", "64:4:150", "96:4:70"], capture_output=True,
                         text=True, timeout=110, cwd=REPO, env=env(TRITON_INTERPRET=1))
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(errors) == 6
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.slow
def test_the_triton_kernel_reads_the_bias_where_it_lies():
    """The comparison above can fail: the kernel's band read one distance off, or the far keys' constants swapped,
    is off by far more than 1e-5 (the kernel is checked against the gathered bias on its own here)."""
    pytest.importorskip("triton")
    script = r"""
import json, torch
from data.audio.w2v_attention import distance_table, gathered_relative_key_attention
from data.audio.w2v_attention_triton import triton_relative_key_attention
q, k, v = torch.randn(3, 2, 3, 150, 16, generator=torch.Generator().manual_seed(0))
embedding = torch.randn(73, 16, generator=torch.Generator().manual_seed(1))
table = distance_table(q, embedding, 0.25)
want = gathered_relative_key_attention(q, k, v, table, None, 0.25, 64, 8)
def error(t):
    return float((triton_relative_key_attention(q, k, v, t, None, 0.25, 64, 8) - want).abs().max() / want.abs().max())
print(json.dumps({"exact": error(table), "shifted": error(table.roll(1, dims=-1)),
                  "ends swapped": error(torch.cat([table[..., -1:], table[..., 1:-1], table[..., :1]], dim=-1))}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110, cwd=REPO,
                         env=env(TRITON_INTERPRET=1))
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert errors["exact"] < 1e-5 and errors["shifted"] > 1e-3 and errors["ends swapped"] > 1e-3, errors
