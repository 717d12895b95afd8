"""benchmarks/quality.py's scoring of a trained codec: every held-out frame it codes, at any --downsample."""
import numpy as np
import torch

from benchmarks.quality import score_encoded
from models.codec import CodecConfig, RVQCodec


class Utterances:
    def __init__(self, lengths, dim):
        rng = np.random.default_rng(0)
        self.dim, self.arrays = dim, [rng.standard_normal((n, dim)).astype(np.float32) for n in lengths]

    def __len__(self):
        return len(self.arrays)

    def utterance(self, i):
        return self.arrays[i]

    @property
    def total_frames(self):
        return sum(map(len, self.arrays))


def test_a_downsampling_codec_is_scored_on_the_frames_it_codes_of_odd_length_utterances():
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=8, latent_dim=16, num_quantizers=2, codebook_size=16, downsample=2,
                                 kmeans_init=False)).eval()
    valid = Utterances([33, 40, 35], dim=8)
    result = score_encoded(model, valid, beam=1, trained={})
    assert result["frames"] == 32 + 40 + 34  # the last frame of an odd utterance is not coded
    assert np.isfinite(result["rel_mse"]) and result["rel_mse"] > 0


def test_a_scored_run_is_named_by_the_flags_it_changed_from_the_defaults():
    from benchmarks.score_runs import changed_flags
    from training.config import parse_args

    config = parse_args(["--downsample", "2", "--lr", "4e-3", "--threads", "1", "--output_dir", "/tmp/x"]).to_dict()
    assert changed_flags(config) == {"downsample": 2, "lr": 0.004}  # where it ran and on how many threads aside


def test_the_error_by_distance_from_the_ends_puts_each_frames_error_in_its_band_and_sums_to_rel_mse():
    from benchmarks.quality import score
    from benchmarks.score_runs import EDGE_BANDS, EdgeErrors

    valid = Utterances([150, 100, 37], dim=4)

    def off_at_the_ends(x):  # the first and last 3 frames reconstructed 1.0 off in every dimension, the rest exact
        x_hat = x.clone()
        x_hat[:3] += 1.0
        x_hat[-3:] += 1.0
        return x_hat, torch.zeros(len(x), 1, dtype=torch.long)

    edges = EdgeErrors()
    result = score(valid, off_at_the_ends, levels=1, size=2, each=edges.add)
    bands = edges.bands(result["rel_mse"])
    assert [b["from_end"] for b in bands] == [f"{a}-{b}" for a, b in zip(EDGE_BANDS, EDGE_BANDS[1:])] + ["64+"]
    assert bands[0]["share"] == round(3 * 16 / 287, 4)  # [0, 8): 8 frames at each end of each utterance
    assert all(b["rel_mse"] == 0 for b in bands[1:]) and bands[0]["rel_mse"] > 0
    assert np.isclose(sum(b["share"] * b["rel_mse"] for b in bands), result["rel_mse"], rtol=1e-3)
    variance = np.concatenate(valid.arrays).var(0).sum()  # a frame's error is 4.0 at the 18 frames off
    assert np.isclose(bands[0]["rel_mse"], 4.0 * 18 / 48 / variance, rtol=1e-6)
