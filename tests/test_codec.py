from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.bad_crops import finite_crops
from models import codec as codec_module
from models.codec import CodecConfig, RVQCodec
from data.audio.pass_plan import length_sorted_batches
from training.codec_passes import encode_batch, encode_in_batches
from models.metrics import EvalSums


@pytest.mark.parametrize("downsample", [1, 2, 4])
def test_forward_encode_decode_agree(downsample):
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=12, latent_dim=16, num_quantizers=3, codebook_size=16,
                                 downsample=downsample))
    # as long as encode's shortest pass (MIN_ENCODE_STEPS codes): it pads a shorter input, which may change the
    # convolutions' last bits and so a near tie's code
    x = torch.randn(3, 64, 12)
    out = model(x)  # training forward: k-means init
    assert out.reconstruction.shape == x.shape
    assert out.codes.shape == (3, 64 // downsample, 3)
    assert set(out._fields) == {"reconstruction", "codes", "recon_loss", "commit_loss", "loss", "latent"}
    assert out.latent.shape == (3, 64 // downsample, 16) and not out.latent.requires_grad  # the expiry's input
    model.eval()
    codes = model.encode(x)  # the codec's beam search (beam_size 4 by default)
    torch.testing.assert_close(model.decode(codes), model(x, beam_size=4).reconstruction)
    torch.testing.assert_close(model(x, beam_size=4).codes, codes)
    greedy = model.encode(x, beam_size=1)
    torch.testing.assert_close(model.decode(greedy), model(x).reconstruction)  # eval forward: training's choice
    assert (((model.decode(codes) - x) ** 2).sum() <= ((model.decode(greedy) - x) ** 2).sum() * 1.001)
    assert model.encode(x[0]).shape == (64 // downsample, 3)
    assert model.encode(x, num_quantizers=2).shape[-1] == 2
    assert model.decode(codes[..., :2]).shape == x.shape


def test_encode_refuses_training_mode():
    model = RVQCodec(CodecConfig(feature_dim=4, latent_dim=8, num_quantizers=1, codebook_size=4))
    with pytest.raises(RuntimeError, match="eval mode"):
        model.encode(torch.randn(8, 4))


@pytest.mark.slow
@pytest.mark.parametrize("downsample", [1, 2, 4])
def test_a_batch_encodes_each_utterance_bit_for_bit_as_alone(downsample):
    """The default codec's encoder, random weights: the padding and the neighbours in a batch change no bit of an
    utterance's latent, so none of its codes (PyTorch picks its conv kernel by input size, and kernels round
    differently: the codec pins one, and keeps the padding out of every layer). A codebook of 128 rather than
    1024 codes: the quantizer codes each frame on its own, and the default's beam search over 8 x 1024 codes
    made this test the suite's slowest."""
    torch.manual_seed(downsample)
    rng = np.random.default_rng(downsample)
    model = RVQCodec(CodecConfig(feature_dim=160, downsample=downsample, codebook_size=128,
                                 kmeans_init=False)).eval()
    model.set_feature_stats(torch.randn(160), torch.rand(160) + 0.5)
    lengths = [0, 1, 2, 3, 5, 8, 17, 64, 129, *rng.integers(1, 300, 5)]
    utterances = [(3 * rng.standard_normal((n, 160))).astype(np.float32) for n in lengths]
    alone = [encode_batch(model, [u])[0] for u in utterances]
    assert [len(c) for c in alone] == [-(-n // downsample) for n in lengths]
    for got, want in zip(encode_batch(model, utterances), alone, strict=True):
        np.testing.assert_array_equal(got, want)
    store = SimpleNamespace(lengths=np.array(lengths), utterance=lambda i: utterances[i])
    for batch_frames in (700, 10**6):  # batches of a few, one batch (each alone is `alone`)
        np.testing.assert_array_equal(encode_in_batches(model, store, 8, batch_frames, np.int16),
                                      np.concatenate(alone))
    with torch.no_grad():  # the latents too, not only their nearest codes
        whole = [torch.from_numpy(u[: len(u) // downsample * downsample]) for u in utterances]
        x = torch.zeros(len(whole), max(map(len, whole)), 160)
        for row, u in zip(x, whole):
            row[: len(u)] = u
        latent = model._encode_latent(x, torch.tensor([len(u) for u in whole]))
        for row, u in zip(latent, whole):
            alone = model._encode_latent(u[None], torch.tensor([len(u)]))[0]
            assert torch.equal(row[: len(u) // downsample], alone[: len(u) // downsample])


@pytest.mark.parametrize("beam", [1, 4])
def test_encode_quantizes_in_parts_on_a_cpu_and_gets_the_codes_of_one_call(beam, monkeypatch):
    """On a CPU the quantizer takes a pass's frames in parts, none over CPU_ONE_HOT_ENTRIES of the beam search's
    one-hot: the codes of every row are those of one call over the whole pass, bit for bit."""
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=24, latent_dim=32, codebook_size=256))
    model(3 * torch.randn(4, 256, 24))  # the k-means init: codebooks with near ties to break
    model.eval()
    x = 3 * torch.randn(3, 300, 24)
    lengths = torch.tensor([300, 211, 37])
    calls = []
    model.rvq.register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[1]))
    monkeypatch.setattr(codec_module, "CPU_ONE_HOT_ENTRIES", 1 << 40)
    whole = model.encode(x, lengths=lengths, beam_size=beam)
    assert calls == [900]
    budget = beam * beam * 256 * 37  # parts of 36-37 code frames
    monkeypatch.setattr(codec_module, "CPU_ONE_HOT_ENTRIES", budget)
    calls.clear()
    parts = model.encode(x, lengths=lengths, beam_size=beam)
    assert len(calls) == 25 and sum(calls) == 900
    assert all(frames * beam * beam * 256 <= budget for frames in calls)
    assert torch.equal(parts, whole)
    assert (parts[2, 37:] == -1).all() and (parts[2, :37] >= 0).all()


def test_length_sorted_batches_cover_every_utterance_once_within_the_budget():
    lengths = np.array([5, 300, 7, 7, 120, 0, 64, 900])
    batches = length_sorted_batches(lengths, 256)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * lengths[batch].max() <= 256
    assert [b.tolist() for b in batches] == [[5, 0, 2, 3], [6, 4], [1], [7]]


def test_eval_sums_give_known_metrics():
    sums = EvalSums(2, 2, 4, "cpu")
    x = torch.tensor([[[1.0, 0.0], [3.0, 0.0]]])
    codes = torch.tensor([[[0, 1], [1, 1]]])
    sums.add(x, x.clone(), codes)
    r = sums.result(downsample=1)
    assert r["rel_mse"] == 0.0 and r["cosine"] == pytest.approx(1.0)
    assert r["code_usage"] == [0.5, 0.25] and r["perplexity"] == [2.0, 1.0] and r["bits_per_frame"] == 4.0
    sums2 = EvalSums(2, 2, 4, "cpu")
    sums2.load_vector(sums.vector() * 1)
    assert sums2.result(1) == r


def test_init_codebooks_on_a_large_sample_uses_every_code_and_scales_cluster_sizes():
    from models.codebook_ops import dead_code_counts

    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=6, latent_dim=8, num_quantizers=2, codebook_size=32,
                                 dead_code_threshold=0.5))
    sample = torch.randn(64, 32, 6)  # 2048 frames, far more than one batch of 64
    model.init_codebooks(sample, batch_frames=64)
    assert all(bool(layer._codebook.initted) for layer in model.rvq.layers)
    for layer in model.rvq.layers:  # cluster sizes on the scale of one batch: 64 frames over 32 codes
        assert float(layer._codebook.cluster_size.sum()) == pytest.approx(64, rel=0.05)
    model.eval()
    codes = model.encode(sample.flatten(0, 1))
    assert all(len(codes[:, q].unique()) >= 28 for q in range(2))
    assert len(dead_code_counts(model)) == 2
    with pytest.raises(RuntimeError, match="training mode"):
        model.init_codebooks(sample, batch_frames=64)


def _trained_with_dead_codes(seed=0):
    """A codec whose codebooks were initialised on a narrow sample: on wider data many codes win nothing."""
    torch.manual_seed(seed)
    model = RVQCodec(CodecConfig(feature_dim=6, latent_dim=8, num_quantizers=2, codebook_size=32))
    model.init_codebooks(torch.randn(8, 16, 6) * 0.05, batch_frames=64)
    model.eval()
    return model


def test_refit_lowers_the_error_and_leaves_no_code_empty():
    model = _trained_with_dead_codes()
    utterances = [torch.randn(n, 6) for n in (300, 200, 500, 250)]
    frames = torch.cat(utterances)

    @torch.no_grad()
    def error():  # the quantizer's error on the latents it is fitted to
        latent = torch.cat([model._encode_latent(u[None]) for u in utterances], dim=1)
        return float(((model.rvq(latent)[0] - latent) ** 2).mean())

    before, codes_before = error(), model.encode(frames)
    encoder = [p.clone() for p in model.encoder.parameters()]
    errors = model.refit_codebooks(utterances, iters=3, batch_frames=64)
    assert len(errors) == 2 and errors[1] < errors[0]
    assert error() < 0.9 * before
    codes = model.encode(frames)  # the codec's beam search, which the refit fitted the codebooks for
    with torch.no_grad():  # the refit's last figure is the error the encoder's beam leaves on its utterances
        latent = torch.cat([model._encode_latent(u[None])[0] for u in utterances])
        mine = torch.cat([model.encode(u) for u in utterances])
        left = latent - model.rvq.get_output_from_indices(mine[None])[0]
    assert float((left**2).mean()) == pytest.approx(errors[-1], rel=0.01)
    for q in range(2):  # every code wins frames of the sample it was fitted on
        assert len(codes_before[:, q].unique()) < 32 and len(codes[:, q].unique()) == 32
    assert all(torch.equal(a, b) for a, b in zip(encoder, model.encoder.parameters()))  # codebooks only
    for layer in model.rvq.layers:  # EMA statistics on the scale of one batch
        assert float(layer._codebook.cluster_size.sum()) == pytest.approx(64, rel=1e-4)
    model.train()
    with pytest.raises(RuntimeError, match="eval mode"):
        model.refit_codebooks(utterances, iters=1, batch_frames=64)


def test_the_refit_fits_the_beam_search_that_encodes():
    """The refit's beam (extend_beam, level by level, scored by the residual left) keeps the best sequence the
    library's beam search finds for encode, under the codec's per-level score weights; the library's own equal
    weights (the sum of every level's residual) would choose other sequences."""
    from models.codebook_ops import extend_beam

    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=6, latent_dim=8, num_quantizers=4, codebook_size=32))
    model(torch.randn(8, 64, 6))  # k-means init
    model.eval()
    x = torch.randn(600, 6)
    with torch.no_grad():
        latent = model._encode_latent(x[None])[0]
        residual = latent[:, None]
        for layer in model.rvq.layers:
            residual = extend_beam(residual, layer._codebook.embed[0], 4)
        left = latent - model.rvq.get_output_from_indices(model.encode(x)[None])[0]
        agree = torch.isclose(left, residual[:, 0], atol=1e-5).all(-1).float().mean()
        greedy = latent - model.rvq.get_output_from_indices(model.encode(x, beam_size=1)[None])[0]
        model.rvq.beam_score_weights.fill_(1.0)
        summed = latent - model.rvq.get_output_from_indices(model.encode(x)[None])[0]
    assert agree >= 0.99
    assert (left**2).sum() < (summed**2).sum() < (greedy**2).sum()


def test_a_lloyd_step_in_chunks_is_the_librarys_kmeans_step(monkeypatch):
    import models.codebook_ops as codebook_ops
    from vector_quantize_pytorch.vector_quantize_pytorch import kmeans

    g = torch.Generator().manual_seed(0)
    samples = torch.randn(5000, 8, generator=g)
    start = samples[:64].clone() + 0.01
    monkeypatch.setitem(codebook_ops.REFIT_CHUNK, "cpu", 700)  # several chunks, the last one short
    means, counts = codebook_ops.lloyd_step(samples, start.clone(), lambda t: t)
    want, bins = kmeans(samples[None], 64, 1, sample_fn=lambda x, n: start[None])
    torch.testing.assert_close(means, want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, bins[0]) and int(counts.sum()) == 5000


def test_split_empty_codes_moves_each_empty_code_beside_a_populous_one():
    from models.codebook_ops import split_empty_codes

    means = torch.tensor([[1.0, 2.0], [5.0, 5.0], [9.0, 9.0], [3.0, 3.0]])
    counts = torch.tensor([10, 0, 1, 0])
    split_empty_codes(means, counts, torch.Generator().manual_seed(0))
    assert int(counts.sum()) == 11 and bool((counts > 0).all())
    # only code 0 has frames beyond its first to give: both empty codes land beside it, a hair apart
    for code in (1, 3):
        torch.testing.assert_close(means[code], torch.tensor([1.0, 2.0]), atol=0.01, rtol=0)
    assert len({tuple(m.tolist()) for m in means}) == 4
    assert torch.equal(means[2], torch.tensor([9.0, 9.0]))


def test_restoring_the_codebook_state_undoes_a_non_finite_forward():
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=12, latent_dim=16, num_quantizers=3, codebook_size=16))
    model(torch.randn(4, 32, 12))  # k-means init and one EMA update
    before = [b.clone() for b in model.rvq.buffers()]
    state = model.codebook_state()
    x = torch.randn(4, 32, 12)
    x[1, 5, 3] = float("nan")
    out = model(x)
    assert not torch.isfinite(out.loss)
    assert not all(torch.isfinite(b).all() for b in model.rvq.buffers() if b.is_floating_point())  # poisoned
    model.restore_codebook_state(state)
    after = list(model.rvq.buffers())
    assert len(after) == len(before)
    for a, b in zip(after, before):  # every byte, so a -0.0 for a 0.0 would fail too
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_a_skipped_first_step_runs_the_kmeans_init_again():
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=12, latent_dim=16, num_quantizers=2, codebook_size=16))
    state = model.codebook_state()
    x = torch.randn(4, 32, 12)
    x[0, 0, 0] = float("inf")
    model(x)
    model.restore_codebook_state(state)
    assert not any(bool(layer._codebook.initted) for layer in model.rvq.layers)
    model(torch.randn(4, 32, 12))
    assert all(bool(layer._codebook.initted) for layer in model.rvq.layers)
    assert all(torch.isfinite(t).all() for t in model.codebook_state() if t.is_floating_point())


def test_a_dropped_crop_leaves_no_trace_in_the_codebooks():
    """A crop with a NaN frame, dropped by `finite_crops`: the quantizer sees the first kept crop in its place
    (no NaN reaches a codebook), the reconstruction loss is that of the batch without it, and the gradient is
    finite."""
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=12, latent_dim=16, num_quantizers=3, codebook_size=16, downsample=2))
    model(torch.randn(8, 32, 12))
    start = model.codebook_state()
    x = torch.randn(8, 32, 12)
    x[3, 5, 2] = float("nan")
    keep = finite_crops(x)
    assert keep.tolist() == [True] * 3 + [False] + [True] * 4
    torch.manual_seed(1)
    masked = model(x, keep)
    after_masked = model.codebook_state()
    assert all(torch.isfinite(t).all() for t in after_masked if t.is_floating_point())
    model.restore_codebook_state(start)
    torch.manual_seed(1)
    replaced = x.clone()
    replaced[3] = x[0]
    same = model(replaced)
    for a, b in zip(after_masked, model.codebook_state()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(masked.commit_loss, same.commit_loss)
    # recon_space "feature": the squared error in feature space over the mean feature variance
    per_crop = ((same.reconstruction - replaced) ** 2).mean((1, 2)) / (model.feature_std ** 2).mean()
    torch.testing.assert_close(masked.recon_loss, per_crop[keep].mean())
    masked.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_batch_with_no_finite_crop_gives_a_non_finite_gradient():
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=12, latent_dim=16, num_quantizers=2, codebook_size=16))
    model(torch.randn(4, 32, 12))
    x = torch.full((4, 32, 12), float("inf"))
    out = model(x, finite_crops(x))
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert not torch.isfinite(norm)  # so the trainer skips the step on every rank


@pytest.mark.timeout(60)
def test_rotation_trick_changes_the_gradient_through_the_quantizer_and_nothing_else():
    """--rotation_trick reaches the library's quantizers: the same codes and loss, another gradient to the encoder."""
    grads, codes = [], []
    for rotation in (False, True):
        torch.manual_seed(0)
        model = RVQCodec(CodecConfig(feature_dim=8, latent_dim=8, num_quantizers=2, codebook_size=8,
                                     kmeans_init=False, rotation_trick=rotation))
        assert all(layer.rotation_trick == rotation for layer in model.rvq.layers)
        out = model(torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1)))
        out.recon_loss.backward()
        codes.append(out.codes)
        grads.append(torch.cat([p.grad.flatten() for p in model.encoder.parameters()]))
    assert torch.equal(codes[0], codes[1]) and not torch.allclose(grads[0], grads[1])


@pytest.mark.timeout(60)
def test_cosine_codebooks_keep_unit_codes_through_the_init_training_expiry_and_refit():
    """--cosine_codebooks: the library's cosine-similarity codebooks, whose codes stay on the unit sphere through
    our own codebook operations (the refit's means are normalised)."""
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=8, latent_dim=8, num_quantizers=2, codebook_size=8,
                                 cosine_codebooks=True, dead_code_threshold=4.0))
    x = torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(1))
    model.train()
    model.init_codebooks(x, 128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 5):
        out = model(x)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.expire_dead_codes(out.latent, out.codes)
    model.eval()
    model.refit_codebooks([x[0], x[1]], 2, 128)
    for codebook in model._codebooks():
        torch.testing.assert_close(codebook.embed[0].norm(dim=-1), torch.ones(8), atol=1e-5, rtol=0)
    codes = model.encode(x[0])
    assert codes.shape == (32, 2) and 0 <= int(codes.min()) and int(codes.max()) < 8


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stride", [2, 4])
def test_the_folded_downsampling_conv_is_the_strided_conv(stride):
    """The encoder's downsampling conv at inference on a CPU (frames folded into the channels, a stride-1 conv) gives
    the strided conv's output, every length's (the last frames of an odd length dropped as the strided conv drops
    them), within float32 rounding."""
    from models.codec import folded_conv

    torch.manual_seed(stride)
    w, b = torch.randn(24, 16, 2 * stride), torch.randn(24)
    for frames in (2 * stride - stride // 2 * 2, 2 * stride, 9, 10, 11, 64, 283):
        x = torch.randn(3, 16, frames)
        want = torch.nn.functional.conv1d(x, w, b, stride=stride, padding=stride // 2)
        got = folded_conv(x, w, b, stride, stride // 2)
        assert got.shape == want.shape, frames
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
