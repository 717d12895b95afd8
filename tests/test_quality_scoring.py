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
