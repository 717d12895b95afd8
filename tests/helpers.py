"""Shared helpers: run the trainer as a user would, and make small feature stores."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "rvq_seamless_gpu_cache_nccl.py"

# A codec small enough that a step takes milliseconds on a CPU.
TINY = ["--latent_dim", "32", "--num_quantizers", "2", "--codebook_size", "32", "--batch_size", "4",
        "--segment_length", "32", "--warmup_steps", "2", "--log_every", "1"]


def env(**extra) -> dict:
    e = dict(os.environ)
    e.pop("RVQ_FAULT", None)
    e["PYTHONPATH"] = str(REPO)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run_trainer(args, *, timeout=240, extra_env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAINER), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env(**(extra_env or {})), cwd=cwd or REPO)


def run_torchrun(args, *, nproc=2, timeout=240, extra_env=None, launcher="torch.distributed.run"):
    cmd = [sys.executable, "-m", launcher, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(TRAINER), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**(extra_env or {})),
                          cwd=REPO)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["event"] == kind]


def write_fairseq(folder: Path, split: str, lengths, dim=16, nshard=1, seed=0) -> list[np.ndarray]:
    """A fairseq dump of random utterances; returns the utterances in order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    utts = [rng.standard_normal((n, dim)).astype(np.float32) for n in lengths]
    per_shard = np.array_split(np.arange(len(utts)), nshard)
    for k, idx in enumerate(per_shard):
        np.save(folder / f"{split}_{k}_{nshard}.npy", np.concatenate([utts[i] for i in idx]))
        (folder / f"{split}_{k}_{nshard}.len").write_text("".join(f"{lengths[i]}\n" for i in idx))
    return utts
