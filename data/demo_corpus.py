"""A deterministic, speech-like demo corpus in the fairseq dump format.

Used when the trainer is given no ``--data_dir``. It imitates the SeamlessM4T
front-end's output (80 log-mel bins, two frames stacked -> 160-d at 50 Hz):
utterances are sequences of phone-like states with durations, smooth
transitions between states, a per-speaker spectral tilt and an energy contour,
plus frame noise. Generated once into a cache folder and reused.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from data.shard_layout import FEATURE_DUMP

log = logging.getLogger(__name__)

DEMO_VERSION = 1
FEATURE_DIM = 160  # 80 mel bins x 2 stacked frames
MEL_BINS = FEATURE_DIM // 2
NUM_PHONES = 48
NUM_SPEAKERS = 12
SPLITS = {"train": (400, 0), "valid": (40, 1)}  # utterances, seed offset
MIN_FRAMES, MAX_FRAMES = 50, 400  # 1 to 8 seconds at 50 Hz


def default_demo_dir() -> Path:
    """Where the demo corpus lives: $RVQ_DEMO_DIR, else .cache/ in the checkout."""
    env = os.environ.get("RVQ_DEMO_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / ".cache" / f"demo_corpus_v{DEMO_VERSION}"


def _phone_inventory(rng: np.random.Generator) -> np.ndarray:
    """Smooth log-mel envelopes with a few formant-like peaks, [NUM_PHONES, MEL_BINS]."""
    bins = np.arange(MEL_BINS)[None, :]
    env = np.zeros((NUM_PHONES, MEL_BINS))
    for p in range(NUM_PHONES):
        for _ in range(rng.integers(2, 5)):
            centre, width, height = rng.uniform(0, MEL_BINS), rng.uniform(2, 10), rng.uniform(1, 4)
            env[p] += height * np.exp(-0.5 * ((bins[0] - centre) / width) ** 2)
        if rng.random() < 0.25:  # fricative-like: energy in the high bins
            env[p] += np.linspace(0, rng.uniform(1, 3), MEL_BINS)
    return env - 6.0


def _utterance(rng, phones, tilts, num_frames: int) -> np.ndarray:
    """One utterance, [num_frames, FEATURE_DIM] float32."""
    speaker = rng.integers(NUM_SPEAKERS)
    states, durations = [], []
    total = 0
    state = rng.integers(NUM_PHONES)
    while total < 2 * num_frames + 2:  # mel frames at 100 Hz before stacking
        states.append(state)
        d = int(rng.integers(4, 24))
        durations.append(d)
        total += d
        state = (state + rng.integers(1, NUM_PHONES)) % NUM_PHONES
    targets = np.repeat(phones[states], durations, axis=0)[: 2 * num_frames + 2]
    # smooth transitions: a short moving average over time
    kernel = np.ones(5) / 5
    smooth = np.stack([np.convolve(targets[:, b], kernel, mode="same") for b in range(MEL_BINS)], axis=1)
    t = np.arange(len(smooth))[:, None]
    energy = 1.5 * np.sin(2 * np.pi * t / rng.uniform(40, 120) + rng.uniform(0, 6.3))
    mel = smooth + tilts[speaker][None, :] + energy + 0.1 * rng.standard_normal(smooth.shape)
    mel = mel[: 2 * num_frames]
    return mel.reshape(num_frames, FEATURE_DIM).astype(np.float32)


def _write_split(folder: Path, split: str, count: int, seed: int, phones, tilts) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(MIN_FRAMES, MAX_FRAMES + 1, size=count)
    feats = np.concatenate([_utterance(rng, phones, tilts, int(n)) for n in lengths])
    np.save(folder / f"{split}_0_1{FEATURE_DUMP.array}", feats)
    (folder / f"{split}_0_1{FEATURE_DUMP.lengths}").write_text("".join(f"{n}\n" for n in lengths))


def ensure_demo_corpus(folder: Path | None = None, seed: int = 1234) -> Path:
    """Build the demo corpus in `folder` unless it is already there; return the folder.

    Safe when several ranks call it at once: each builds in its own temporary
    folder and renames it into place; the content is identical, the first wins.
    """
    folder = Path(folder) if folder else default_demo_dir()
    if (folder / f"valid_0_1{FEATURE_DUMP.lengths}").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp", dir=folder.parent))
    try:
        rng = np.random.default_rng(seed)
        phones = _phone_inventory(rng)
        bins = np.linspace(-1, 1, MEL_BINS)
        tilts = np.stack([rng.uniform(-1.5, 1.5) * bins + rng.uniform(-1, 1) for _ in range(NUM_SPEAKERS)])
        for split, (count, offset) in SPLITS.items():
            _write_split(tmp, split, count, seed + 1 + offset, phones, tilts)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / f"valid_0_1{FEATURE_DUMP.lengths}").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
