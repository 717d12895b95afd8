"""Small audio corpora made on the spot (speech from espeak-ng, tones, chirps, noise), a tiny random w2v-BERT, and the
CLI runner for the pipeline steps."""
from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np

from tests.helpers import env, run_python


def voice_like(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A gliding harmonic tone with a syllable-rate envelope and a little noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 110 + 60 * rng.random() + 30 * np.sin(2 * np.pi * (0.5 + rng.random()) * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * (3 + 2 * rng.random()) * t) ** 2
    x = 0.25 * envelope * voiced + 0.02 * rng.standard_normal(len(t))
    return (x / max(1.0, np.abs(x).max() * 1.05)).astype(np.float32)


SENTENCES = ("The quick brown fox jumps over the lazy dog.", "Seven silver swans swam south in the spring.",
             "Please call Stella and ask her to bring these things.", "A rainbow is a division of white light.",
             "She sells sea shells by the sea shore.", "We will tokenize ten thousand hours of speech.")


def spoken(seconds: float, rate: int, seed: int) -> np.ndarray:
    """Real speech: one of SENTENCES said by espeak-ng (`apt-get install espeak-ng`), resampled to `rate` and cut
    (or padded with silence) to `seconds`, in [-1, 1]."""
    import soundfile as sf
    import soxr

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("the audio tests speak with espeak-ng: apt-get install espeak-ng")
    wav = subprocess.run(["espeak-ng", "--stdout", "-s", str(140 + 10 * (seed % 5)), "-p", str(30 + 7 * (seed % 6)),
                          SENTENCES[seed % len(SENTENCES)]], capture_output=True, check=True, timeout=30).stdout
    x, native = sf.read(io.BytesIO(wav), dtype="float32")
    x = soxr.resample(x, native, rate) if native != rate else x
    n = int(seconds * rate)
    x = np.pad(x[:n], (0, max(0, n - len(x))))
    return (0.9 * x / max(1e-3, np.abs(x).max())).astype(np.float32)


def chirp(seconds: float, rate: int, f_start=200.0, f_end=3000.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    f = f_start + (f_end - f_start) * t / seconds
    return (0.3 * np.sin(2 * np.pi * np.cumsum(f) / rate)).astype(np.float32)


# (relpath, seconds, sample rate, channels): 16 kHz wav, resampled flac and ogg, stereo, a sub-folder
CORPUS = [
    ("a00.wav", 1.2, 16000, 1), ("a01.flac", 2.1, 22050, 1), ("a02.ogg", 1.6, 44100, 2),
    ("a03.wav", 2.8, 16000, 1), ("a04.flac", 1.0, 16000, 2), ("a05.wav", 1.9, 48000, 1),
    ("sub/a06.wav", 2.4, 16000, 1), ("sub/a07.flac", 1.4, 8000, 1), ("a08.wav", 3.0, 16000, 1),
    ("a09.ogg", 2.2, 16000, 1),
]


def write_corpus(folder: Path, corpus=CORPUS) -> list[str]:
    """Write the corpus under `folder`; returns the relpaths in the order tools.extract lists a folder."""
    import soundfile as sf

    for k, (rel, seconds, rate, channels) in enumerate(corpus):
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        x = chirp(seconds, rate) if k % 4 == 3 else voice_like(seconds, rate, seed=k)
        if channels == 2:
            x = np.stack([x, 0.6 * x[::-1]], axis=1)
        subtype = "PCM_16" if path.suffix == ".wav" else None
        sf.write(path, x, rate, subtype=subtype)
    return sorted(rel for rel, *_ in corpus)


def run_module(module: str, *args, timeout=120) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repo root, as a user runs a pipeline step."""
    return run_python(["-m", module, *args], env=env(), timeout=timeout)


def tiny_w2v_bert(folder: Path, seed: int = 0) -> Path:
    """A random Wav2Vec2BertModel small enough for a CPU test, saved with save_pretrained into `folder`."""
    import torch
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    torch.manual_seed(seed)
    config = Wav2Vec2BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                output_hidden_size=32, feature_projection_input_dim=160, conv_depthwise_kernel_size=5)
    Wav2Vec2BertModel(config).eval().save_pretrained(folder)
    return folder


def random_codec(path: Path, data_dir: Path, feature_dim: int = 32, **config) -> Path:
    """A checkpoint of an untrained codec for the features of `data_dir` (`feature_dim` wide), recording them as
    the trainer does; `config`: CodecConfig fields other than the defaults here (downsample=4, say)."""
    from data.feature_settings import dump_feature_settings

    return codec_checkpoint(path, dump_feature_settings(data_dir, "train"), feature_dim, **config)


def codec_checkpoint(path: Path, features: dict, feature_dim: int, step: int = 0, **config) -> Path:
    """A checkpoint of an untrained codec (seeded) at `step`, recording that it was trained on `features`; `config`:
    CodecConfig fields other than the defaults here."""
    import torch

    from models.codec import CodecConfig, RVQCodec

    torch.manual_seed(0)
    config = CodecConfig(**{"feature_dim": feature_dim, "latent_dim": 16, "num_quantizers": 2, "codebook_size": 16,
                            "kmeans_init": False, **config})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": RVQCodec(config).state_dict(), "codec": config.to_dict(), "step": step,
                "config": {"features": features}}, path)
    return path
