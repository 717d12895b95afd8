"""One codec per output, features checked before they are encoded, and the codec described when a tool loads it:
a real second checkpoint of a run trained on, a run still training, fbank features offered to a demo codec."""
import json
import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data.demo_corpus import default_demo_dir
from data.feature_settings import describe, dump_feature_settings, settings_differ
from models.codec import CodecConfig, RVQCodec
from tests.helpers import REPO, TRAINER, TINY, _state, env, events, start_python, trainer_in_process
from tools import encode, extract, tokenize
from rvq_tokenizer.codec_files import TRUSTED_STEPS, codec_doubts, load_codec
from tests.audio_helpers import CORPUS, write_corpus

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

# the demo codec: no refit, a short eval, a small k-means init, so that a run takes seconds
DEMO = [*TINY, "--refit_iters", 0, "--eval_frames", 256, "--kmeans_init_frames", 512, "--compile", "off"]
SHARDS = ["--nshard", 40, "--beam_size", 1]  # 10 demo utterances a shard


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A codec trained 3 steps on the demo corpus, and a fbank dump of the same width from three audio files."""
    root = tmp_path_factory.mktemp("codec_identity")
    d = SimpleNamespace(root=root, run=root / "run", audio=root / "audio", fbank=root / "fbank")
    r = trainer_in_process(["--output_dir", d.run, "--max_steps", 3, *DEMO])
    assert r.returncode == 0, r.stderr[-3000:]
    d.data = default_demo_dir()
    write_corpus(d.audio, CORPUS[:3])
    assert extract.main([d.audio, "train", 1, 0, d.fbank, "--feature", "fbank", "--num_workers", 0]) == 0
    return d


def encode_demo(d, out, rank, *flags):
    return encode.main(["--data_dir", d.data, "--output_dir", out, *SHARDS, "--rank", rank, *flags])


def meta(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.codes.json").read_text())


@pytest.mark.timeout(150)
def test_a_shard_of_another_checkpoint_or_of_a_run_still_training_exits_2_naming_both(demo, tmp_path, caplog):
    d, out = demo, tmp_path / "codes"
    first = d.run / "checkpoints" / "step_00000003.pt"
    assert encode_demo(d, out, 0, "--checkpoint", d.run) == 0
    zero = meta(out, "train_0_40")
    assert (zero["checkpoint"], zero["step"]) == (str(first.resolve()), 3)
    assert zero["codec_digest"].startswith("sha256:")
    assert zero["feature_check"].startswith("the statistics of the first")  # demo features: no notes, stats agree
    # the run trains on, for real: while it holds its --output_dir, RUN is refused
    trainer = start_python([TRAINER, "--output_dir", d.run, "--max_steps", "100000", "--save_every", "100000", *DEMO],
                           stdout=tmp_path / "trainer.log", env=env())
    try:
        deadline = time.monotonic() + 90
        while not [e for e in (events(d.run, "train") if (d.run / "metrics.jsonl").exists() else [])
                   if e["step"] >= 5]:
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()
            time.sleep(0.2)
        caplog.clear()
        assert encode_demo(d, out, 1, "--checkpoint", d.run) == 2
        assert "still training" in caplog.text and f"pid {trainer.pid}" in caplog.text and str(first) in caplog.text
    finally:
        trainer.send_signal(signal.SIGTERM)  # a stop on request: it saves the step it reached
        assert trainer.wait(timeout=60) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    second = sorted((d.run / "checkpoints").glob("step_*.pt"))[-1]
    assert second != first
    caplog.clear()
    assert encode_demo(d, out, 1, "--checkpoint", d.run) == 2
    assert str(first.resolve()) in caplog.text and str(second.resolve()) in caplog.text
    assert f"--checkpoint {first.resolve()}" in caplog.text  # the fix offered works:
    assert not list(out.glob("train_1_40.*"))
    assert encode_demo(d, out, 1, "--checkpoint", first) == 0
    assert meta(out, "train_1_40")["codec_digest"] == zero["codec_digest"]
    caplog.clear()  # the codes decode with their own codec only
    assert encode.main(["decode", "--checkpoint", d.run, "--codes_dir", out, "--split", "train", "--nshard", 40,
                        "--rank", 1, "--output_dir", tmp_path / "recon"]) == 2
    assert f"codec {first.resolve()} (step 3)" in caplog.text and not (tmp_path / "recon").exists()
    # shard 0 again with the newer codec: its own codes name the other one (--overwrite would not mix: shard 1's)
    caplog.clear()
    assert encode_demo(d, out, 0, "--checkpoint", d.run, "--overwrite") == 2
    assert "train_1_40.codes.json holds codes of the codec" in caplog.text
    assert meta(out, "train_0_40") == zero


def fbank_codec(path: Path, feats: Path, seed: int) -> Path:
    """A checkpoint of an untrained codec recording the fbank features of `feats`, as the trainer records them."""
    torch.manual_seed(seed)
    config = CodecConfig(feature_dim=160, latent_dim=16, num_quantizers=2, codebook_size=16, kmeans_init=False)
    torch.save({"model": RVQCodec(config).state_dict(), "codec": config.to_dict(), "step": 0,
                "config": {"features": dump_feature_settings(feats, "train")}}, path)
    return path


@pytest.mark.timeout(60)
def test_tokenize_refuses_a_second_codec_in_one_output_and_flags_that_differ_without_nones(demo, tmp_path, caplog):
    d, out = demo, tmp_path / "codes"
    a, b = fbank_codec(tmp_path / "a.pt", d.fbank, 0), fbank_codec(tmp_path / "b.pt", d.fbank, 1)
    common = [d.audio, "train", 2, None, out, "--num_workers", 0]
    assert tokenize.main([*common[:3], 0, *common[4:], "--checkpoint", a]) == 0
    assert "trained 0 steps" in caplog.text  # an untrained codec is warned about
    caplog.clear()
    assert tokenize.main([*common[:3], 1, *common[4:], "--checkpoint", b]) == 2
    assert f"codec {a.resolve()} (step 0); this command's codec is {b.resolve()} (step 0)" in caplog.text
    assert not list(out.glob("train_1_2.*"))
    caplog.clear()
    assert tokenize.main([*common[:3], 1, *common[4:], "--checkpoint", a, "--feature", "w2v-bert",
                          "--layer", 17]) == 2
    assert "None" not in caplog.text and "feature: 'fbank' -> 'w2v-bert'" in caplog.text
    assert "Leave out --feature w2v-bert --layer 17" in caplog.text


@pytest.mark.timeout(90)
def test_a_second_codec_started_before_the_first_shard_commits_anything_exits_2(demo, tmp_path, caplog):
    """Two commands into one output with two codecs, the second started while the first has committed nothing yet
    (stopped before its first commit): the first's shard names its codec from its start."""
    d, out = demo, tmp_path / "codes"
    a, b = fbank_codec(tmp_path / "a.pt", d.fbank, 0), fbank_codec(tmp_path / "b.pt", d.fbank, 1)
    first = subprocess.Popen([sys.executable, "-m", "tools.tokenize", str(d.audio), "train", "2", "0", str(out),
                              "--num_workers", "0", "--commit_files", "1", "--checkpoint", str(a)],
                             cwd=REPO, env=env(RVQ_FAULT="hang:step=1"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while _state(first.pid) != "T":  # SIGSTOPped before its first commit
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        assert json.loads((out / "train_0_2.codes.progress").read_text())["done"] == 0
        assert tokenize.main([d.audio, "train", 2, 1, out, "--num_workers", 0, "--checkpoint", b]) == 2
        assert f"codec {a.resolve()} (step 0); this command's codec is {b.resolve()} (step 0)" in caplog.text
        assert not list(out.glob("train_1_2.*"))
    finally:
        first.kill()
        first.wait(timeout=30)
    assert tokenize.main([d.audio, "train", 2, 0, out, "--num_workers", 0, "--commit_files", 1,
                          "--checkpoint", a]) == 0  # the first resumes from its start, and finishes


@pytest.mark.timeout(60)
def test_encode_refuses_features_that_are_not_the_codecs_unless_told(demo, tmp_path, caplog):
    d = demo
    codec = ["--checkpoint", d.run / "checkpoints" / "step_00000003.pt"]
    # fbank features with tools.extract's notes: their settings are not the demo codec's
    assert encode.main([*codec, "--data_dir", d.fbank, "--output_dir", tmp_path / "noted"]) == 2
    assert "feature: 'demo' -> 'fbank'" in caplog.text and "--allow_feature_mismatch" in caplog.text
    assert not (tmp_path / "noted").exists()
    # the same features without notes: their statistics give them away
    bare = tmp_path / "bare"
    bare.mkdir()
    for ext in (".npy", ".len"):
        shutil.copy(d.fbank / f"train_0_1{ext}", bare)
    caplog.clear()
    assert encode.main([*codec, "--data_dir", bare, "--output_dir", tmp_path / "bare_codes"]) == 2
    assert "nats per dimension from the statistics" in caplog.text
    assert not (tmp_path / "bare_codes").exists()
    assert encode.main([*codec, "--data_dir", bare, "--output_dir", tmp_path / "bare_codes",
                        "--allow_feature_mismatch"]) == 0
    assert meta(tmp_path / "bare_codes", "train_0_1")["feature_check"].startswith("not the codec's")


def test_the_checkpoint_records_the_last_eval_and_the_tools_say_how_trained_the_codec_is(demo, caplog):
    state = torch.load(demo.run / "checkpoints" / "step_00000003.pt", weights_only=True)
    final = events(demo.run, "eval")[-1]
    assert state["eval"] == {"step": 3, "rel_mse": final["rel_mse"], "final": True}
    load_codec(demo.run / "checkpoints" / "step_00000003.pt")
    assert f"step 3, final eval rel_mse {final['rel_mse']:.4f}" in caplog.text
    assert "too briefly trained" in caplog.text and "trained 3 steps" in caplog.text
    trusted = {**state, "step": TRUSTED_STEPS, "eval": {"step": TRUSTED_STEPS, "rel_mse": 0.1, "final": True}}
    assert codec_doubts(trusted) == []
    assert len(codec_doubts({**trusted, "end_of_schedule": ["refit"]})) == 1  # no final eval
    assert len(codec_doubts({**trusted, "eval": {**trusted["eval"], "rel_mse": 0.935}})) == 1


def test_feature_descriptions_name_what_is_known_and_differences_only_what_differs():
    assert describe({"feature": "w2v-bert", "layer": 17}) == "w2v-bert layer 17"
    assert settings_differ({"feature": "demo"}, {"feature": "fbank", "dim": 160}) == "feature: 'demo' -> 'fbank'"
    assert settings_differ({"feature": "w2v-bert", "layer": 17, "model": "m"},
                           {"feature": "w2v-bert", "layer": 12, "model": "m", "dtype": "float16"}) == (
        "layer: 17 -> 12, dtype: (absent) -> 'float16'")
