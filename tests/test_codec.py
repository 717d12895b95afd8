import pytest
import torch

from models.codec import CodecConfig, RVQCodec
from models.metrics import EvalSums


@pytest.mark.parametrize("downsample", [1, 2, 4])
def test_forward_encode_decode_agree(downsample):
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=12, latent_dim=16, num_quantizers=3, codebook_size=16,
                                 downsample=downsample))
    x = torch.randn(3, 32, 12)
    out = model(x)  # training forward: k-means init
    assert out.reconstruction.shape == x.shape
    assert out.codes.shape == (3, 32 // downsample, 3)
    assert set(out._fields) == {"reconstruction", "codes", "recon_loss", "commit_loss", "loss"}
    model.eval()
    codes = model.encode(x)
    torch.testing.assert_close(model.decode(codes), model(x).reconstruction)
    assert model.encode(x[0]).shape == (32 // downsample, 3)
    assert model.encode(x, num_quantizers=2).shape[-1] == 2
    assert model.decode(codes[..., :2]).shape == x.shape


def test_encode_refuses_training_mode():
    model = RVQCodec(CodecConfig(feature_dim=4, latent_dim=8, num_quantizers=1, codebook_size=4))
    with pytest.raises(RuntimeError, match="eval mode"):
        model.encode(torch.randn(8, 4))


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
    from models.codec import dead_code_counts

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
