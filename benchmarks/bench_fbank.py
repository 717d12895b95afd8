"""Front-end speed on one core: the Seamless fbank in torch (data/audio/fbank.py) against transformers'
SeamlessM4TFeatureExtractor, alone and inside `python -m tools.extract --feature fbank`.

1. The front-end alone: the files decoded beforehand, then each front-end over all of them (SeamlessFbank, as the
   decoding workers call it): audio seconds per second, and the largest difference between the two front-ends'
   features over the corpus (and the share of values equal to the last bit). The torch front-end also with other
   numbers of frames per pass (data/audio/fbank.py CPU_FRAMES_PER_PASS, the default; "all": one pass a file).
2. End to end: `python -m tools.extract SRC train 1 0 OUT --feature fbank --num_workers 0 --front_end F` (reading,
   resampling, front-end, writing and committing) against reading the same files as tools.extract does
   (data/audio/features.py load_audio: soundfile, mono, soxr to 16 kHz) and running transformers' extractor,
   nothing written. Start-up aside: the tool's own figure (from its pipeline's start to its last commit) less
   that of a run on the corpus's first three files (one of each format: the first calls' warm-up), over the
   audio of the other files.

One core: this process and the tool are pinned to one CPU (sched_setaffinity), torch on one thread, numpy's BLAS
and OpenMP on one thread. Each measurement takes turns with the others for --repeats rounds and keeps its fastest
(on shared cores the slower runs are other people's work). Corpora: `mixed`, the files of bench_extract.py (2-20 s;
16 kHz wav, 22.05 kHz flac, stereo 44.1 kHz ogg: decoding and resampling are real work), and `flac16k`, the same
lengths as 16 kHz mono flac (LibriSpeech's format: no resampling).

    python benchmarks/bench_fbank.py [--files 40] [--seconds 2,20] [--repeats 5] [--corpora mixed,flac16k]
        [--out benchmarks/results/bench_fbank.json] [--table /tmp/figs/fbank.md]
"""
from __future__ import annotations

import os

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy and torch load
    os.environ[_name] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_extract import write_corpus as write_mixed_corpus  # noqa: E402
from benchmarks.demo_run import command_line, machine  # noqa: E402
from data.audio.features import SeamlessFbank, load_audio  # noqa: E402
from data.manifests import list_audio_folder  # noqa: E402
from data.audio.fbank import CPU_FRAMES_PER_PASS, TorchFbank  # noqa: E402
from tests.audio_helpers import chirp, voice_like  # noqa: E402

FRONT_ENDS = ("torch", "transformers")
WARM_FILES = 3  # the first files, a run on which is subtracted from the tool's figure
PASSES = (64, 256, 1 << 30)  # frames per pass tried beside the default
READ_LINE = re.compile(r"read ([\d.]+) s of audio in [\d.]+ s: ([\d.]+) audio seconds per second")


def write_flac16k_corpus(folder: Path, files: int, seconds: tuple[float, float], seed: int = 0) -> float:
    """bench_extract.py's lengths and signals, as 16 kHz mono flac."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    total = 0.0
    for k in range(files):
        length = rng.uniform(*seconds)
        x = chirp(length, 16000) if k % 4 == 3 else voice_like(length, 16000, seed=k)
        sf.write(folder / f"f{k:03d}.flac", x, 16000)
        total += length
    return total


def front_end_alone(waves: list[np.ndarray], front_end: str) -> tuple[float, list[np.ndarray]]:
    fbank = SeamlessFbank(None, front_end)
    began = time.perf_counter()
    features = [fbank(wave) for wave in waves]
    return time.perf_counter() - began, features


def torch_passes(waves: list[np.ndarray], frames_per_pass: int) -> float:
    fbank = TorchFbank(frames_per_pass=frames_per_pass)
    began = time.perf_counter()
    for wave in waves:
        fbank(wave).numpy()
    return time.perf_counter() - began


def read_and_extract(paths: list[Path]) -> float:
    """Seconds to read every file as tools.extract does and run transformers' extractor on it."""
    fbank = SeamlessFbank(None, "transformers")
    began = time.perf_counter()
    for path in paths:
        fbank(load_audio(path))
    return time.perf_counter() - began


def tool_run(audio: Path, out: Path, front_end: str) -> tuple[float, float]:
    """(the seconds tools.extract says its pipeline took, from its audio and rate, the more precise figures; the
    process's wall seconds)."""
    began = time.perf_counter()
    job = subprocess.run([sys.executable, "-m", "tools.extract", str(audio), "train", "1", "0", str(out),
                          "--feature", "fbank", "--num_workers", "0", "--front_end", front_end],
                         capture_output=True, text=True, cwd=REPO, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - began
    said = READ_LINE.search(job.stderr)
    if job.returncode or said is None:
        raise SystemExit(f"tools.extract --front_end {front_end} failed: {job.stderr[-2000:]}")
    return float(said.group(1)) / float(said.group(2)), wall


def compare(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    assert [x.shape for x in a] == [y.shape for y in b], "the front-ends disagree on frame counts"
    flat_a, flat_b = np.concatenate(a), np.concatenate(b)
    return {"max_abs_diff": float(np.abs(flat_a - flat_b).max()),
            "mean_abs_diff": float(np.abs(flat_a - flat_b).mean()),
            "equal_share": float((flat_a == flat_b).mean())}


def bench_corpus(name: str, folder: Path, audio_seconds: float, repeats: int, out: Path) -> dict:
    paths = [folder / rel for rel in list_audio_folder(folder)]
    waves = [load_audio(p) for p in paths]
    audio = sum(len(w) for w in waves) / 16000
    best: dict[str, float] = {}
    features = {}
    walls: dict[str, float] = {}
    warm = out / f"{name}_first_files"
    warm.mkdir(parents=True)
    for path in paths[:WARM_FILES]:
        shutil.copy(path, warm / path.name)
    warm_audio = sum(len(w) for w in waves[:WARM_FILES]) / 16000

    def keep(key: str, seconds: float) -> None:
        best[key] = min(best.get(key, float("inf")), seconds)

    for r in range(repeats):  # round after round: each measurement meets the machine's load alike
        for front_end in FRONT_ENDS:
            seconds, features[front_end] = front_end_alone(waves, front_end)
            keep(f"front-end alone: {front_end}" + (f" ({CPU_FRAMES_PER_PASS} frames a pass)" if front_end == "torch"
                                                    else ""), seconds)
        for frames in PASSES:
            keep(f"front-end alone: torch, {'all' if frames == 1 << 30 else frames} frames a pass",
                 torch_passes(waves, frames))
        keep("read + transformers' extractor", read_and_extract(paths))
        for front_end in FRONT_ENDS:
            seconds, wall = tool_run(folder, out / f"{name}_{front_end}_{r}", front_end)
            keep(f"tool: {front_end}", seconds)
            keep(f"tool on the first files: {front_end}", tool_run(warm, out / f"{name}_{front_end}_first_{r}",
                                                                   front_end)[0])
            walls[front_end] = min(walls.get(front_end, float("inf")), wall)
    dumps = {}
    for front_end in FRONT_ENDS:
        d = out / f"{name}_{front_end}_0"
        lengths = [int(n) for n in (d / "train_0_1.len").read_text().split()]
        dumps[front_end] = np.split(np.load(d / "train_0_1.npy"), np.cumsum(lengths)[:-1])
    own_figures = {key: round(best.pop(key), 4) for key in [k for k in best if k.startswith("tool")]}
    rows = {key: {"seconds": round(s, 3), "audio_s_per_s": round(audio / s, 1),
                  "ms_per_audio_s": round(1000 * s / audio, 3)} for key, s in best.items()}
    for front_end in FRONT_ENDS:
        s = own_figures[f"tool: {front_end}"] - own_figures[f"tool on the first files: {front_end}"]
        rows[f"tools.extract --front_end {front_end}"] = {
            "seconds": round(s, 3), "audio_s_per_s": round((audio - warm_audio) / s, 1),
            "ms_per_audio_s": round(1000 * s / (audio - warm_audio), 3)}
    alone = rows["front-end alone: transformers"]["audio_s_per_s"]
    reading = rows["read + transformers' extractor"]["audio_s_per_s"]
    for key, row in rows.items():
        row["speed_up"] = round(row["audio_s_per_s"] / (alone if key.startswith("front-end") else reading), 2)
    return {"files": len(paths), "audio_seconds": round(audio, 1), "generated_seconds": round(audio_seconds, 1),
            "rows": rows, "front_ends_alone": compare(features["torch"], features["transformers"]),
            "front_ends_in_dumps": compare(dumps["torch"], dumps["transformers"]),
            "tool_own_figures_seconds": own_figures, "first_files_audio_seconds": round(warm_audio, 1),
            "tool_wall_seconds": {k: round(v, 2) for k, v in walls.items()}}


def table(info: dict) -> str:
    lines = [f"Machine: {info['machine']}; pinned to CPU {info['cpu']}, torch threads {info['torch_threads']}, "
             f"1-min load before {info['load_average_before'][0]}, after {info['load_average_after'][0]}; "
             f"fastest of {info['repeats']} rounds.", "",
             "| corpus | what | audio s / s | ms per audio s | speed-up |", "|---|---|---:|---:|---:|"]
    for corpus, result in info["corpora"].items():
        for key, row in result["rows"].items():
            base = "vs the extractor alone" if key.startswith("front-end") else "vs read + extractor"
            lines.append(f"| {corpus} ({result['audio_seconds'] / 60:.1f} min, {result['files']} files) | {key} | "
                         f"{row['audio_s_per_s']:,.1f} | {row['ms_per_audio_s']:.3f} | {row['speed_up']:.2f}x "
                         f"({base}) |")
    lines += ["", "| corpus | torch vs transformers | max abs diff | mean abs diff | values equal to the bit |",
              "|---|---|---:|---:|---:|"]
    for corpus, result in info["corpora"].items():
        for what in ("front_ends_alone", "front_ends_in_dumps"):
            d = result[what]
            lines.append(f"| {corpus} | {what.replace('_', ' ')} | {d['max_abs_diff']:.2e} | "
                         f"{d['mean_abs_diff']:.2e} | {d['equal_share']:.1%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=40)
    p.add_argument("--seconds", default="2,20", help="shortest and longest file, uniformly drawn between")
    p.add_argument("--repeats", type=int, default=5, help="rounds, the fastest of each measurement kept")
    p.add_argument("--corpora", default="mixed,flac16k", help="mixed, flac16k, or both")
    p.add_argument("--cpu", type=int, help="the CPU to pin to (default: the last this process may use)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_fbank.json")
    p.add_argument("--table", type=Path, help="also write the tables (markdown) here")
    args = p.parse_args()
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})  # the tool's processes inherit it
    torch.set_num_threads(1)
    seconds = tuple(float(x) for x in args.seconds.split(","))
    info = {"machine": machine(), "cpu": cpu, "torch_threads": torch.get_num_threads(),
            "load_average_before": [round(x, 2) for x in os.getloadavg()], "files": args.files, "seconds": seconds,
            "repeats": args.repeats, "command": command_line(), "corpora": {}}
    print(f"{info['machine']}; CPU {cpu}, 1-min load {info['load_average_before'][0]}", flush=True)
    writers = {"mixed": write_mixed_corpus, "flac16k": write_flac16k_corpus}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for corpus in args.corpora.split(","):
            folder = tmp / corpus
            folder.mkdir()
            generated = writers[corpus](folder, args.files, seconds)
            info["corpora"][corpus] = bench_corpus(corpus, folder, generated, args.repeats, tmp / "out")
            print(json.dumps({corpus: info["corpora"][corpus]}, indent=1), flush=True)
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    text = table(info)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
