"""Extraction speed: `python -m tools.extract` (decoding in worker processes, w2v-BERT passes length-sorted across
each commit window) against today's loop before it (groups of files in list order, each read and turned into
fbank on the main thread, then the model, then the write: nothing overlaps).

A generated corpus (voice-like tones and chirps of --seconds, at 16, 22.05 and 44.1 kHz, wav, flac and ogg, some
stereo: the resampling is real work) and, for w2v-BERT, a small random Wav2Vec2BertModel (the speed does not
depend on the weights). For each feature and loop: audio seconds per second of the loop (read, features, write;
the model's load not counted) and the model's input wait, the share of that time the model waited for decoded
audio (today's loop: the main thread's decoding, which the model always waits for). The loops take turns for
--repeats rounds and each keeps its fastest run (on shared cores the slower ones are other people's work).
The features of both loops are checked alike (fbank: equal; w2v-BERT: equal but for the padding's last bits).
Both loops run with numpy's BLAS on one thread, as tools.extract now sets it; a last table runs the command
itself (fbank, no workers) with numpy's BLAS on one thread and on every core, as before.

    python benchmarks/bench_extract.py [--files 40] [--seconds 2,20] [--workers 0,1,2] [--commit_seconds 60]
        [--repeats 3] [--features fbank,w2v-bert] [--threads N] [--out benchmarks/results/bench_extract.json]
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as tools.extract sets it, before numpy loads: both loops alike

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from data.audio.features import SAMPLE_RATE, SeamlessFbank, W2vBertLayer, load_audio  # noqa: E402
from data.dump_writer import NpyRowWriter  # noqa: E402
from data.manifests import list_audio_folder  # noqa: E402
from tests.audio_helpers import chirp, voice_like  # noqa: E402
from tools import extract  # noqa: E402

SMALL_W2V = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                 output_hidden_size=256, feature_projection_input_dim=160, conv_depthwise_kernel_size=31)
LAYER = 4
TODAY_GROUP = {"fbank": 16, "w2v-bert": 8}  # files per group in today's loop; w2v-BERT: 8 chunks a pass


def write_corpus(folder: Path, files: int, seconds: tuple[float, float], seed: int = 0) -> float:
    """`files` audio files of uniformly drawn durations; returns the seconds of audio."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    total = 0.0
    for k in range(files):
        rate, suffix, channels = ((16000, ".wav", 1), (22050, ".flac", 1), (44100, ".ogg", 2))[k % 3]
        length = rng.uniform(*seconds)
        x = chirp(length, rate) if k % 4 == 3 else voice_like(length, rate, seed=k)
        if channels == 2:
            x = np.stack([x, 0.6 * x[::-1]], axis=1)
        sf.write(folder / f"f{k:03d}{suffix}", x, rate, subtype="PCM_16" if suffix == ".wav" else None)
        total += length
    return total


def todays_loop(root: Path, relpaths: list[str], fbank: SeamlessFbank, encoder: W2vBertLayer | None,
                group: int, out_dir: Path) -> tuple[list[np.ndarray], dict]:
    """The extraction loop before this change: per group of files, read and fbank each on this thread, then the
    model over the group's chunks, then the write (checked finite, appended to the .npy, fsynced at the end)."""
    out, wait, audio = [], 0.0, 0.0
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = NpyRowWriter(out_dir / "train_0_1.npy", encoder.dim if encoder else fbank.dim)
    began = time.perf_counter()
    for g in range(0, len(relpaths), group):
        start = time.perf_counter()
        fbanks = []
        for rel in relpaths[g : g + group]:
            wave = load_audio(root / rel)
            audio += len(wave) / SAMPLE_RATE
            fbanks.append(fbank(wave))
        wait += time.perf_counter() - start
        for f in (fbanks if encoder is None else old_passes(encoder, fbanks, group)):
            f = np.asarray(f, dtype=np.float32)
            if np.isfinite(f).all():
                writer.append(f)
                out.append(f)
    os.replace(writer.finish(), writer.path)
    seconds = time.perf_counter() - began
    return out, {"audio_s_per_s": round(audio / seconds, 1), "input_wait_frac": round(wait / seconds, 3),
                 "seconds": round(seconds, 2)}


def old_passes(encoder: W2vBertLayer, fbanks: list[np.ndarray], group: int) -> list[np.ndarray]:
    """Today's w2v-BERT batching: the group's chunks sorted by length, `group` of them a pass."""
    pieces = [(i, c) for i, f in enumerate(fbanks) for c in encoder.chunks(f)]
    order = sorted(range(len(pieces)), key=lambda k: len(pieces[k][1]))
    outputs = [None] * len(pieces)
    for first in range(0, len(order), group):
        batch = order[first : first + group]
        for k, o in zip(batch, encoder.forward([pieces[k][1] for k in batch])):
            outputs[k] = o
    per_file = [[] for _ in fbanks]
    for (i, _), o in zip(pieces, outputs):
        per_file[i].append(o)
    return [np.concatenate(parts) for parts in per_file]


class ExtractTiming(logging.Handler):
    """Reads tools.extract's closing line: audio seconds per second and the input wait."""

    def __init__(self):
        super().__init__()
        self.figures = None

    def emit(self, record):
        m = re.match(r"read ([\d.]+) s of audio in ([\d.]+) s: ([\d.]+) audio seconds per second; .* waited "
                     r"([\d.]+) s", record.getMessage())
        if m:
            audio, seconds, _, wait = map(float, m.groups())
            self.figures = {"audio_s_per_s": round(audio / seconds, 1), "input_wait_frac": round(wait / seconds, 3),
                            "seconds": round(seconds, 2)}


def new_loop(audio: Path, out: Path, flags: list, timing: ExtractTiming) -> tuple[list[np.ndarray], dict]:
    if extract.main([audio, "train", 1, 0, out, *flags]) != 0:
        raise SystemExit(f"tools.extract {flags} failed")
    array = np.load(out / "train_0_1.npy")
    lengths = np.loadtxt(out / "train_0_1.len", dtype=np.int64, ndmin=1)
    return np.split(array, np.cumsum(lengths)[:-1]), timing.figures


def command_runs(audio: Path, out: Path, repeats: int, timing: ExtractTiming) -> dict:
    """`python -m tools.extract` (fbank, no workers) with numpy's BLAS on one thread (its default now) and on every
    core (numpy's default, and the command's before): audio seconds per second, the fastest of `repeats`."""
    cores = len(os.sched_getaffinity(0))
    rows = {}
    for name, threads in (("numpy BLAS on one thread (now)", "1"), (f"numpy BLAS on {cores} threads (before)",
                                                                      str(cores))):
        best = None
        for r in range(repeats):
            job = subprocess.run([sys.executable, "-m", "tools.extract", str(audio), "train", "1", "0",
                                  str(out / f"{threads}_{r}"), "--num_workers", "0"], capture_output=True, text=True, cwd=REPO, timeout=600,
                                 env={**os.environ, "OPENBLAS_NUM_THREADS": threads, "PYTHONPATH": str(REPO)})
            timing.figures = None
            for line in job.stderr.splitlines():
                timing.emit(logging.makeLogRecord({"msg": line.split(" INFO ", 1)[-1]}))
            if job.returncode or timing.figures is None:
                raise SystemExit(f"tools.extract failed: {job.stderr[-2000:]}")
            if best is None or timing.figures["audio_s_per_s"] > best["audio_s_per_s"]:
                best = timing.figures
        rows[name] = best
    return rows


def fastest(runs: list[tuple[list, dict]]) -> tuple[list, dict]:
    return max(runs, key=lambda r: r[1]["audio_s_per_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=40)
    p.add_argument("--seconds", default="2,20", help="shortest and longest file, uniformly drawn between")
    p.add_argument("--workers", default="0,1,2", help="tools.extract's --num_workers, each a run")
    p.add_argument("--commit_seconds", type=float, default=60.0,
                   help="tools.extract's: windows of a minute of audio, so that this short corpus holds several (the "
                        "model's wait for the first window is not overlapped; the tool's default, 600, is one here)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of runs, the fastest of each loop kept")
    p.add_argument("--features", default="fbank,w2v-bert", help="which features, each a table")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_extract.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = ExtractTiming()
    logging.getLogger("extract").addHandler(timing)
    logging.getLogger("extract").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "audio").mkdir()
        seconds = tuple(float(x) for x in args.seconds.split(","))
        total = write_corpus(tmp / "audio", args.files, seconds)
        from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

        torch.manual_seed(0)
        Wav2Vec2BertModel(Wav2Vec2BertConfig(**SMALL_W2V)).eval().save_pretrained(tmp / "w2v")
        info = {"machine": machine(), "torch_threads": torch.get_num_threads(),
                "load_average_before": [round(x, 2) for x in os.getloadavg()], "files": args.files,
                "seconds": seconds, "audio_seconds": round(total, 1), "w2v_bert": {**SMALL_W2V, "layer": LAYER},
                "repeats": args.repeats, "commit_seconds": args.commit_seconds, "runs": {}}
        print(f"{info['machine']}, {info['torch_threads']} torch threads, 1-min load {info['load_average_before'][0]}")
        print(f"{args.files} files of {seconds[0]:g}-{seconds[1]:g} s at 16-44.1 kHz ({total / 60:.1f} min); "
              f"w2v-BERT {SMALL_W2V['hidden_size']}-d x {SMALL_W2V['num_hidden_layers']} layers, layer {LAYER}\n")
        print("| features | loop | audio s / s | model input wait | speed-up |")
        print("|---|---|---:|---:|---:|")
        relpaths = list_audio_folder(tmp / "audio")
        for feature in args.features.split(","):
            fbank = SeamlessFbank(None)
            encoder = W2vBertLayer(tmp / "w2v", LAYER, device=torch.device("cpu"), dtype=torch.float32,
                                   max_chunk_seconds=30) if feature == "w2v-bert" else None
            model = ["--feature", "w2v-bert", "--checkpoint", tmp / "w2v", "--layer", LAYER, "--device", "cpu"] \
                if feature == "w2v-bert" else []
            loops = {f"today's loop (groups of {TODAY_GROUP[feature]} files)":
                     lambda out: todays_loop(tmp / "audio", relpaths, fbank, encoder, TODAY_GROUP[feature], out)}
            for workers in [int(w) for w in args.workers.split(",")]:
                flags = [*model, "--num_workers", workers, "--commit_seconds", args.commit_seconds]
                loops[f"tools.extract --num_workers {workers}"] = \
                    lambda out, flags=flags: new_loop(tmp / "audio", out, flags, timing)
            runs = {name: [] for name in loops}
            for r in range(args.repeats):  # round after round: each loop meets the machine's load alike
                for k, (name, loop) in enumerate(loops.items()):
                    runs[name].append(loop(tmp / f"out_{feature}_{k}_{r}"))
            want = fastest(runs[next(iter(loops))])[0]
            rows = {}
            for name, done in runs.items():
                got, rows[name] = fastest(done)
                for a, b in zip(got, want, strict=True):  # the same features, or the runs compare nothing
                    if feature == "fbank":
                        np.testing.assert_array_equal(a, b)
                    else:
                        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
            today = next(iter(rows.values()))
            for name, row in rows.items():
                row["speed_up"] = round(row["audio_s_per_s"] / today["audio_s_per_s"], 2)
                print(f"| {feature} | {name} | {row['audio_s_per_s']:,.1f} | {row['input_wait_frac']:.0%} | "
                      f"{row['speed_up']:.2f}x |", flush=True)
                info["runs"][f"{feature}: {name}"] = row
        commands = command_runs(tmp / "audio", tmp / "command", args.repeats, timing)
        print("\n| python -m tools.extract (fbank, --num_workers 0) | audio s / s |\n|---|---:|")
        for name, row in commands.items():
            print(f"| {name} | {row['audio_s_per_s']:,.1f} |")
        info["command"] = commands
        info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        print(f"\n1-min load after: {info['load_average_after'][0]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
