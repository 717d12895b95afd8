"""rvq_tokenizer's `encode` of a list of utterances against `python -m tools.tokenize` over the same files, side by
side: audio seconds per second, and the codes checked equal bit for bit.

A generated corpus (bench_extract.py's: voice-like tones and chirps at 16, 22.05 and 44.1 kHz, wav, flac and ogg,
a third of them stereo) of --files utterances; a codec of the default size (8 levels x 1024 codes, latent 160),
freshly initialised (the speed does not depend on the weights), recording the features of a short extraction:
the fbank, or a small random w2v-BERT (bench_tokenize.py's `small`, 4 layers of 256, to layer 4). For each feature
kind, in turns for --repeats rounds, each keeping its fastest run (on shared cores the slower runs are other
people's work):

- tools.tokenize: `python -m tools.tokenize AUDIO train 1 0 OUT --checkpoint CODEC`, its defaults (one decoding
  worker per spare core); audio seconds per second as it logs them (decoding, features, codes and writing; the
  process's start and the model's load aside), and the whole command's wall time;
- encode: in a process of its own, `tokenizer.encode(waves, rates)` on the files' samples already in memory (as
  soundfile reads them), timed from the call to its return; the load (`rvq_tokenizer.load`) is timed apart;
- encode_files: `tokenizer.encode_files(paths)` in the same process, its decoding workers started by the call.

Both sides run --threads torch threads (OMP_NUM_THREADS). Each run's codes are checked equal to tools.tokenize's.

    python benchmarks/bench_rvq_tokenizer.py [--files 64] [--seconds 1,8] [--features fbank,w2v-bert]
        [--repeats 3] [--threads 1] [--out benchmarks/results/bench_rvq_tokenizer.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_extract import write_corpus  # noqa: E402
from benchmarks.bench_tokenize import DEFAULT_LAYER, save_model  # noqa: E402
from benchmarks.demo_run import machine  # noqa: E402

RATE = re.compile(r"read ([\d.]+) s of audio in ([\d.]+) s: ([\d.]+) audio seconds per second")
MODEL = "small"  # bench_tokenize.py's small random w2v-BERT


def make_codec(tmp: Path, audio: Path, feature: str, threads: dict) -> Path:
    """A default-sized codec that records the features tools.extract makes of the corpus's first files."""
    from tests.audio_helpers import random_codec

    sample, feats = tmp / f"sample_{feature}", tmp / f"feats_{feature}"
    sample.mkdir()
    for path in sorted(audio.iterdir())[:3]:
        (sample / path.name).write_bytes(path.read_bytes())
    flags = []
    if feature == "w2v-bert":
        save_model(tmp / "w2v_bert", MODEL)
        flags = ["--feature", "w2v-bert", "--checkpoint", str(tmp / "w2v_bert"), "--layer", str(DEFAULT_LAYER[MODEL]),
                 "--device", "cpu"]
    done = subprocess.run([sys.executable, "-m", "tools.extract", str(sample), "train", "1", "0", str(feats), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **threads})
    if done.returncode != 0:
        raise SystemExit(f"tools.extract failed:\n{done.stderr[-3000:]}")
    dim = int(np.load(feats / "train_0_1.npy", mmap_mode="r").shape[1])
    return random_codec(tmp / f"codec_{feature}.pt", feats, feature_dim=dim, latent_dim=160, num_quantizers=8,
                        codebook_size=1024)


def tokenize(audio: Path, codec: Path, out: Path, threads: dict) -> dict:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tools.tokenize", str(audio), "train", "1", "0", str(out),
                           "--checkpoint", str(codec), "--overwrite"], cwd=REPO, capture_output=True, text=True,
                          timeout=3600, env={**os.environ, **threads})
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"tools.tokenize failed:\n{done.stderr[-3000:]}")
    audio_seconds, seconds, rate = map(float, RATE.search(done.stderr).groups())
    return {"audio_seconds": audio_seconds, "seconds": seconds, "audio_seconds_per_second": rate,
            "wall_seconds": round(wall, 2)}


def tokenizer_run(audio: Path, codec: Path, codes: Path, tmp: Path, threads: dict) -> dict:
    """encode and encode_files in a process of their own (child), their codes checked against `codes`."""
    spec, result = tmp / "spec.json", tmp / "result.json"
    spec.write_text(json.dumps({"audio": str(audio), "codec": str(codec), "codes": str(codes),
                                "result": str(result)}))
    done = subprocess.run([sys.executable, __file__, "--child", str(spec)], cwd=REPO, capture_output=True, text=True,
                          timeout=3600, env={**os.environ, **threads})
    if done.returncode != 0:
        raise SystemExit(f"the tokenizer's run failed:\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def child(spec_path: str) -> int:
    import soundfile as sf

    import rvq_tokenizer

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["codes"])
    tsv = (out / "train_0_1.codes.tsv").read_text().splitlines()
    paths = [str(Path(tsv[0]) / line.split("\t")[0]) for line in tsv[1:]]  # tools.tokenize's order
    want = np.load(out / "train_0_1.codes.npy")
    began = time.perf_counter()
    tokenizer = rvq_tokenizer.load(spec["codec"], device="cpu")
    loaded = time.perf_counter() - began
    read = [sf.read(path, dtype="float32") for path in paths]
    waves, rates = [wave for wave, _ in read], [rate for _, rate in read]
    audio_seconds = sum(len(wave) / rate for wave, rate in zip(waves, rates))
    result = {"load_seconds": round(loaded, 2), "audio_seconds": round(audio_seconds, 1)}
    for name, call in (("encode", lambda: tokenizer.encode(waves, rates)),
                       ("encode_files", lambda: tokenizer.encode_files(paths))):
        began = time.perf_counter()
        codes = call()
        seconds = time.perf_counter() - began
        if not np.array_equal(np.concatenate(codes), want):
            raise SystemExit(f"{name}: other codes than tools.tokenize's")
        result[name] = {"seconds": round(seconds, 2), "audio_seconds_per_second": round(audio_seconds / seconds, 1)}
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--seconds", default="1,8", help="min,max seconds per file")
    p.add_argument("--features", default="fbank,w2v-bert")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of both sides (OMP_NUM_THREADS)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_rvq_tokenizer.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    low, high = map(float, args.seconds.split(","))
    features = args.features.split(",")
    runs: dict[str, dict[str, list]] = {f: {"tools.tokenize": [], "rvq_tokenizer": []} for f in features}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "audio").mkdir()
        total = write_corpus(tmp / "audio", args.files, (low, high))
        codecs = {f: make_codec(tmp, tmp / "audio", f, threads) for f in features}
        for _ in range(args.repeats):
            for feature, codec in codecs.items():
                out = tmp / f"codes_{feature}"
                runs[feature]["tools.tokenize"].append(tokenize(tmp / "audio", codec, out, threads))
                runs[feature]["rvq_tokenizer"].append(tokenizer_run(tmp / "audio", codec, out, tmp, threads))
    best = {}
    for feature, by in runs.items():
        tool = max(by["tools.tokenize"], key=lambda r: r["audio_seconds_per_second"])
        ours = {k: max(by["rvq_tokenizer"], key=lambda r: r[k]["audio_seconds_per_second"])[k]
                for k in ("encode", "encode_files")}
        best[feature] = {"tools.tokenize": tool, **ours,
                         **{f"{k} / tools.tokenize": round(ours[k]["audio_seconds_per_second"]
                                                           / tool["audio_seconds_per_second"], 3) for k in ours}}
    result = {"machine": machine(), "load_average_at_start": [round(x, 2) for x in load], "files": args.files,
              "audio_seconds": round(total, 1), "seconds": args.seconds, "threads": args.threads,
              "repeats": args.repeats, "codec": "8 levels x 1024 codes, latent 160, beam 4 (the defaults), untrained",
              "w2v_bert": f"{MODEL}, layer {DEFAULT_LAYER[MODEL]}", "runs": runs, "best": best}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['machine']}; {args.files} files, {total / 60:.1f} min of audio, {args.threads} torch thread(s), "
          f"best of {args.repeats}; 1-minute load {load[0]:.1f} at the start")
    print("| features | tools.tokenize, audio s/s | encode (list in memory) | x tokenize | encode_files | x tokenize |")
    print("|---|---:|---:|---:|---:|---:|")
    for feature, b in best.items():
        print(f"| {feature} | {b['tools.tokenize']['audio_seconds_per_second']:.1f} | "
              f"{b['encode']['audio_seconds_per_second']:.1f} | {b['encode / tools.tokenize']:.2f}x | "
              f"{b['encode_files']['audio_seconds_per_second']:.1f} | {b['encode_files / tools.tokenize']:.2f}x |")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
