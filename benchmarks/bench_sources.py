"""Extraction speed by source: the same audio as loose files in a folder, as WebDataset tar shards, as Hugging Face
parquet and as a Lhotse CutSet, each through `python -m tools.extract` with its defaults (fbank).

A generated corpus (bench_extract.py's: voice-like tones and chirps at 16, 22.05 and 44.1 kHz, wav, flac and ogg,
some stereo) is written once as files, then packed with each format's own library: tars of --per_tar samples
(webdataset's TarWriter), parquet files of --per_tar rows in row groups of --row_group (pyarrow, the Hub's
{bytes, path} Audio layout), and a CutSet of whole recordings (lhotse). For each source: audio seconds per second as
the tool logs it (reading, features and writing; start-up not counted) and the whole command's wall time, each
source taking its turn for --repeats rounds and keeping its fastest run (on shared cores the slower runs are other
people's work); the ratio to the folder's is the figure. The features from every source are checked equal to the
folder's, utterance by utterance.

    python benchmarks/bench_sources.py [--files 120] [--seconds 2,12] [--per_tar 40] [--row_group 20]
        [--repeats 3] [--num_workers N] [--out benchmarks/results/bench_sources.json]
"""
from __future__ import annotations

import argparse
import json
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
from benchmarks.demo_run import machine  # noqa: E402

RATE = re.compile(r"read ([\d.]+) s of audio in ([\d.]+) s: ([\d.]+) audio seconds per second")


def pack(folder: Path, tmp: Path, per_tar: int, row_group: int) -> dict[str, str]:
    """The folder's files as tar shards, parquet files and a CutSet; {source name: SOURCE argument}."""
    import lhotse
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    files = sorted(p for p in folder.iterdir() if p.is_file())
    (tmp / "tars").mkdir()
    (tmp / "parquet").mkdir()
    for n, start in enumerate(range(0, len(files), per_tar)):
        group = files[start:start + per_tar]
        with wds.TarWriter(str(tmp / "tars" / f"train-{n:06d}.tar")) as sink:
            for path in group:
                sink.write({"__key__": path.stem, path.suffix[1:]: path.read_bytes()})
        table = pa.table({"id": [p.stem for p in group],
                          "audio": [{"bytes": p.read_bytes(), "path": p.name} for p in group]})
        pq.write_table(table, tmp / "parquet" / f"train-{n:05d}.parquet", row_group_size=row_group)
    last = (len(files) - 1) // per_tar
    cuts = lhotse.CutSet.from_cuts(lhotse.Recording.from_file(str(p), recording_id=p.stem).to_cut() for p in files)
    cuts.to_file(str(tmp / "cuts.jsonl.gz"))
    return {"folder": str(folder), "tar shards": str(tmp / "tars" / f"train-{{000000..{last:06d}}}.tar"),
            "parquet": str(tmp / "parquet"), "lhotse": str(tmp / "cuts.jsonl.gz")}


def run(source: str, out: Path, workers: list[str]) -> dict:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tools.extract", source, "train", "1", "0", str(out), "--overwrite",
                           *workers], cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"tools.extract {source} failed:\n{done.stderr[-3000:]}")
    audio, seconds, rate = map(float, RATE.search(done.stderr).groups())
    return {"audio_seconds": audio, "seconds": seconds, "audio_seconds_per_second": rate, "wall_seconds": wall}


def features_by_key(out: Path) -> dict[str, np.ndarray]:
    lines = (out / "train_0_1.tsv").read_text().split("\n")[1:]
    keys = [Path(line.split("\t")[0]).stem for line in lines if line]
    lengths = np.cumsum([0] + [int(n) for n in (out / "train_0_1.len").read_text().split()])
    array = np.load(out / "train_0_1.npy", mmap_mode="r")
    return {k: np.asarray(array[lengths[i]:lengths[i + 1]]) for i, k in enumerate(keys)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=120)
    p.add_argument("--seconds", default="2,12", help="min,max seconds per file")
    p.add_argument("--per_tar", type=int, default=40, help="samples per tar, rows per parquet file")
    p.add_argument("--row_group", type=int, default=20, help="rows per parquet row group")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num_workers", type=int, help="tools.extract's --num_workers (default: its own)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_sources.json")
    args = p.parse_args()
    workers = [] if args.num_workers is None else ["--num_workers", str(args.num_workers)]
    low, high = map(float, args.seconds.split(","))
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "audio").mkdir()
        total = write_corpus(tmp / "audio", args.files, (low, high))
        sources = pack(tmp / "audio", tmp, args.per_tar, args.row_group)
        runs: dict[str, list[dict]] = {s: [] for s in sources}
        for _ in range(args.repeats):
            for name_, source in sources.items():
                runs[name_].append(run(source, tmp / name_.replace(" ", "_"), workers))
        reference = features_by_key(tmp / "folder")
        for name_ in sources:
            got = features_by_key(tmp / name_.replace(" ", "_"))
            assert got.keys() == reference.keys(), name_
            assert all(np.array_equal(got[k], reference[k]) for k in got), f"{name_}: other features"
    best = {s: max(r, key=lambda x: x["audio_seconds_per_second"]) for s, r in runs.items()}
    base = best["folder"]
    result = {"machine": machine(), "files": args.files, "audio_seconds": round(total, 1), "seconds": args.seconds,
              "per_tar": args.per_tar, "row_group": args.row_group, "repeats": args.repeats,
              "num_workers": args.num_workers, "runs": runs,
              "ratio_to_folder": {s: round(b["audio_seconds_per_second"] / base["audio_seconds_per_second"], 3)
                                  for s, b in best.items()},
              "wall_ratio_to_folder": {s: round(base["wall_seconds"] / b["wall_seconds"], 3) for s, b in best.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['machine']}; {args.files} files, {total / 60:.1f} min of audio, fbank, best of {args.repeats}")
    print(f"{'source':<12} {'audio s/s':>10} {'x folder':>9} {'wall s':>8} {'x folder':>9}")
    for s, b in best.items():
        print(f"{s:<12} {b['audio_seconds_per_second']:>10.1f} {result['ratio_to_folder'][s]:>9.3f} "
              f"{b['wall_seconds']:>8.2f} {result['wall_ratio_to_folder'][s]:>9.3f}")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
