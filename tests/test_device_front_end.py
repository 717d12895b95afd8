"""The fbank on the device (data/audio/pipeline.py): the workers only decode, the model's device computes the fbank
of a window's files in batches. Forced here on the CPU (FBANK_ON_DEVICE), as on a GPU it is by default: the same
features as the workers' fbank within 1e-4, a killed shard resumed to the bytes of an unbroken run on that path,
and tools.tokenize on it still tools.extract + tools.encode bit for bit."""
import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.audio import pipeline as audio_pipeline
from data.audio.features import SeamlessFbank
from data.audio.pipeline import FeatureWindows
from data.audio.sources import Utterances
from data.feature_settings import dump_feature_settings
from models.codec import CodecConfig, RVQCodec
from tests.audio_helpers import CORPUS, tiny_w2v_bert, write_corpus
from tests.helpers import REPO, env
from tools import encode, extract, tokenize

pytestmark = pytest.mark.timeout(60)

SHARD = "train_0_1"
COMMIT = ["--commit_files", 2]
W2V = ["--feature", "w2v-bert", "--layer", 1, "--max_chunk_seconds", 1.0, "--batch_seconds", 2.5, "--device", "cpu"]
DUMP = (".npy", ".len", ".tsv", ".skipped", ".json")
ON_CPU = ("cuda", "cpu")  # FBANK_ON_DEVICE with the CPU among the devices that compute the fbank


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six short files, a bad one among them, and a tiny random w2v-BERT."""
    root = tmp_path_factory.mktemp("device_front_end")
    audio = root / "audio"
    write_corpus(audio, CORPUS[:6])
    (audio / "bad.wav").write_text("not audio\n" * 20)
    tiny_w2v_bert(root / "w2v_bert")
    return root


def dump(folder: Path) -> tuple[list[np.ndarray], dict]:
    array = np.load(folder / f"{SHARD}.npy")
    lengths = [int(n) for n in (folder / f"{SHARD}.len").read_text().split()]
    texts = {ext: (folder / f"{SHARD}{ext}").read_text() for ext in (".len", ".tsv", ".skipped")}
    return np.split(array, np.cumsum(lengths)[:-1]), texts


def extracted(corpus: Path, out: Path, monkeypatch, on_device: bool, *flags) -> Path:
    with monkeypatch.context() as m:
        if on_device:
            m.setattr(audio_pipeline, "FBANK_ON_DEVICE", ON_CPU)
        assert extract.main([corpus / "audio", "train", 1, 0, out, *COMMIT, *flags]) == 0
    return out


@pytest.mark.parametrize("feature", ["fbank", "w2v-bert"])
def test_the_devices_fbank_gives_the_workers_features_within_1e4(corpus, tmp_path, monkeypatch, caplog, feature):
    flags = ["--device", "cpu"] if feature == "fbank" else [*W2V, "--checkpoint", corpus / "w2v_bert"]
    workers = extracted(corpus, tmp_path / "workers", monkeypatch, False, *flags)
    assert "the fbank is computed by the decoding workers" in caplog.text
    device = extracted(corpus, tmp_path / "device", monkeypatch, True, *flags)
    assert "the fbank is computed on cpu from the decoded audio" in caplog.text
    (want, want_texts), (got, got_texts) = dump(workers), dump(device)
    assert got_texts == want_texts and len(got) == 6  # the same files, frames and skips
    assert got_texts[".skipped"].startswith("bad.wav\tunreadable")
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    assert worst <= 1e-4, worst
    assert json.loads((device / f"{SHARD}.json").read_text())["front_end"] == "torch"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU: the GPU's own check of the path it takes by default"))])
def test_a_window_gets_the_devices_fbank_and_each_file_its_own(corpus, device):
    """FeatureWindows forced either way: the device's fbank of a window's files, in one batch, is each file's;
    copied back, as float16, by the thread that writes (Window.ready)."""
    relpaths = sorted(p.name for p in (corpus / "audio").iterdir() if p.name != "bad.wav")
    windows = {}
    for on_device in (False, True):
        pipeline = FeatureWindows(Utterances.files(corpus / "audio", relpaths), fbank=SeamlessFbank(None), encoder=None,
                                  dtype="float16", num_workers=0, commit_files=4, commit_seconds=1e9,
                                  device=torch.device(device), fbank_on_device=on_device)
        windows[on_device] = list(pipeline.windows(0))
        assert (pipeline.device_fbank is not None) == on_device
    assert [w.end for w in windows[True]] == [w.end for w in windows[False]] == [4, 6]
    for got, want in zip(windows[True], windows[False], strict=True):
        got.ready(), want.ready()
        for g, w in zip(got.files, want.files, strict=True):
            assert g.features.dtype == np.float16 and g.features.shape == w.features.shape
            np.testing.assert_allclose(g.features.astype(np.float32), w.features.astype(np.float32), rtol=2e-3,
                                       atol=1e-4)  # one float16 step at most
    with pytest.raises(ValueError, match="transformers front-end cannot run on the device"):
        FeatureWindows(Utterances.files(corpus / "audio", relpaths), fbank=SeamlessFbank(None, "transformers"),
                       encoder=None, dtype="float32", num_workers=0, commit_files=4, commit_seconds=1e9,
                       fbank_on_device=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_shard_on_the_devices_fbank_resumes_to_the_bytes_of_one_never_stopped(corpus, tmp_path,
                                                                                       monkeypatch, caplog):
    args = [corpus / "audio", "train", 1, 0, tmp_path / "killed", *COMMIT, *W2V, "--checkpoint",
            corpus / "w2v_bert", "--num_workers", 1]
    forced = (f"import sys, runpy; import data.audio.pipeline as p; p.FBANK_ON_DEVICE = {ON_CPU!r}; "
              f"sys.argv = ['tools.extract', *sys.argv[1:]]; runpy.run_module('tools.extract', run_name='__main__')")
    killed = subprocess.run([sys.executable, "-c", forced, *map(str, args)], capture_output=True, text=True,
                            timeout=90, cwd=REPO,  # the threads of this process: the same sums, the same bits
                            env=env(RVQ_FAULT="kill:step=2", OMP_NUM_THREADS=torch.get_num_threads()))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "the fbank is computed on cpu from the decoded audio" in killed.stderr
    committed = json.loads((tmp_path / "killed" / f"{SHARD}.progress").read_text())
    assert committed["done"] == 2 and committed["commits"] == 1
    monkeypatch.setattr(audio_pipeline, "FBANK_ON_DEVICE", ON_CPU)
    assert extract.main(args) == 0 and "resuming at file 2 of 7" in caplog.text
    unbroken = extracted(corpus, tmp_path / "unbroken", monkeypatch, True, *W2V, "--checkpoint", corpus / "w2v_bert")
    for ext in DUMP:
        assert (tmp_path / "killed" / f"{SHARD}{ext}").read_bytes() == (unbroken / f"{SHARD}{ext}").read_bytes(), ext


@pytest.mark.timeout(120)
def test_tokenize_on_the_devices_fbank_is_extract_then_encode_bit_for_bit(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(audio_pipeline, "FBANK_ON_DEVICE", ON_CPU)
    feats = extracted(corpus, tmp_path / "feats", monkeypatch, True, *W2V, "--checkpoint", corpus / "w2v_bert",
                      "--dtype", "float16")
    torch.manual_seed(0)
    config = CodecConfig(feature_dim=32, latent_dim=16, num_quantizers=2, codebook_size=16, kmeans_init=False,
                         downsample=2)
    codec = tmp_path / "codec.pt"
    torch.save({"model": RVQCodec(config).state_dict(), "codec": config.to_dict(), "step": 0,
                "config": {"features": dump_feature_settings(feats, "train")}}, codec)
    assert encode.main(["--checkpoint", codec, "--data_dir", feats, "--output_dir", tmp_path / "encoded",
                        "--km"]) == 0
    assert tokenize.main([corpus / "audio", "train", 1, 0, tmp_path / "tokenized", "--checkpoint", codec, *COMMIT,
                          "--batch_seconds", 2.5, "--km"]) == 0
    for ext in (".codes.npy", ".codes.len", ".codes.tsv", ".km"):
        assert (tmp_path / "tokenized" / f"{SHARD}{ext}").read_bytes() == \
            (tmp_path / "encoded" / f"{SHARD}{ext}").read_bytes(), ext
