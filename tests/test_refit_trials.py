"""benchmarks/refit_trials.py: the usage that sampling allows, the rare-code count, and a trial end to end."""
import numpy as np
import torch

from benchmarks.refit_trials import expected_usage, rare_codes, trial
from data.stores import open_stores
from models.codec import CodecConfig, RVQCodec
from tests.helpers import write_fairseq


def test_the_expected_usage_of_uniform_codes_is_one_less_the_chance_a_code_is_never_drawn():
    assert np.isclose(expected_usage(np.full(64, 5.0), 100), 1 - (63 / 64) ** 100)
    assert expected_usage(np.full(64, 5.0), 10**6) > 0.9999
    assert expected_usage(np.array([1.0, 0.0, 3.0]), 50) < 2 / 3 + 1e-12  # a code never drawn is never used


def test_the_expected_usage_is_what_samples_drawn_at_those_frequencies_use_on_average():
    rng = np.random.default_rng(0)
    counts = rng.pareto(1.5, 256) + 0.01  # skewed, as a trained level's codes are
    p = counts / counts.sum()
    seen = [len(np.unique(rng.choice(256, size=400, p=p))) / 256 for _ in range(400)]
    assert abs(np.mean(seen) - expected_usage(counts, 400)) < 0.005
    assert expected_usage(counts, 400) < expected_usage(np.ones(256), 400)  # skew uses fewer codes


def test_rare_codes_are_those_under_the_share_of_the_mean_count():
    counts = np.array([0, 1, 2, 30, 30, 37])  # mean 16.67: under a tenth of it, 0 and 1
    assert rare_codes(counts, 0.1) == 2
    assert rare_codes(counts, 0.5) == 3


def test_a_trial_refits_a_checkpoint_once_per_seed_and_reports_the_held_out_usage_beside_what_its_size_allows(
        tmp_path):
    torch.manual_seed(0)
    config = CodecConfig(feature_dim=8, latent_dim=16, num_quantizers=2, codebook_size=16, downsample=2,
                         kmeans_init=False, beam_size=2)
    model = RVQCodec(config)
    path = tmp_path / "step_00000007.pt"
    torch.save({"model": model.state_dict(), "codec": model.config.to_dict(), "step": 7}, path)
    write_fairseq(tmp_path / "data", "train", [70, 64, 81, 66], dim=8)
    write_fairseq(tmp_path / "data", "valid", [40, 51], dim=8)
    train, valid, _ = open_stores(tmp_path / "data", "train", "valid", seed=0)
    row = trial(path, train, valid, seeds=[3, 4], iters=2, refit_frames=10**6, train_utterances=2)
    assert row["step"] == 7 and len(row["before"]["rare_codes"]) == 2
    assert [r["seed"] for r in row["refits"]] == [3, 4]
    for r in row["refits"]:
        assert r["heldout_code_frames"] == 20 + 25
        assert len(r["heldout_usage"]) == len(r["usage_expected_at_that_size"]) == 2
        assert all(0 < u <= 1 for u in r["heldout_usage"] + r["usage_expected_at_that_size"])
        assert np.isfinite(r["heldout_rel_mse"]) and np.isfinite(r["train_rel_mse"])
        assert r["heldout_latent_mse"] > 0 and row["before"]["heldout_latent_mse"] > 0
    assert all(0 <= n <= 16 for n in row["before"]["rare_codes"])
    one = trial(path, train, valid, seeds=[3], iters=2, refit_frames=10**6, train_utterances=2, usage_utterances=1)
    assert one["refits"][0]["heldout_rel_mse"] == row["refits"][0]["heldout_rel_mse"]  # the same refit, fewer counted
    assert sum(one["before"]["rare_codes"]) >= sum(row["before"]["rare_codes"])  # 35 code frames for 16 codes


def test_a_path_that_holds_no_codec_ends_with_exit_2_and_names_it(tmp_path, monkeypatch, capsys):
    from benchmarks import refit_trials

    write_fairseq(tmp_path / "data", "train", [70, 64], dim=8)
    write_fairseq(tmp_path / "data", "valid", [40], dim=8)
    out = tmp_path / "out.json"
    monkeypatch.setattr("sys.argv", ["refit_trials.py", "--data_dir", str(tmp_path / "data"),
                                     str(tmp_path / "nowhere"), "--out", str(out), "--threads", "1"])
    threads = torch.get_num_threads()
    try:
        assert refit_trials.main() == 2
    finally:
        torch.set_num_threads(threads)  # main sets its --threads: this worker's other tests keep theirs
    assert f"checkpoint {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_the_latent_residual_of_one_level_nearest_codes_is_each_latent_frame_s_distance_to_its_nearest_code(
        tmp_path):
    from benchmarks.quality import score_encoded
    from benchmarks.refit_trials import scored

    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=8, latent_dim=16, num_quantizers=1, codebook_size=16, downsample=2,
                                 kmeans_init=False, beam_size=1)).eval()
    write_fairseq(tmp_path / "data", "train", [70, 64], dim=8)
    write_fairseq(tmp_path / "data", "valid", [40, 51], dim=8)
    _, valid, _ = open_stores(tmp_path / "data", "train", "valid", seed=0)
    codebook = model.rvq.layers[0]._codebook.embed[0]
    expected, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(valid)):
            x = torch.from_numpy(np.array(valid.utterance(i), dtype=np.float32))
            latent = model._encode_latent(x[None, : len(x) // 2 * 2])[0]
            expected += float(torch.cdist(latent, codebook).min(1).values.pow(2).sum())
            count += latent.numel()
    assert np.isclose(scored(model, valid)["latent_mse"], expected / count, rtol=1e-4)
    assert scored(model, valid)["latent_mse"] > 0
    assert scored(model, valid)["rel_mse"] == score_encoded(model, valid, 1, {})["rel_mse"]  # quality.py's score
