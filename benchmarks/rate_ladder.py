"""The codec's rate ladder: what the codes keep per bit, at 50, 25 and 12.5 code frames a second, beside faiss.

For one feature store (the demo corpus when --data_dir is absent), each codec of --codecs is trained by the trainer
(benchmarks/quality.py run_codec: its defaults and the codec's flags, --max_minutes or, with --max_steps, a budget
in steps), encoded once through `encode` (its own beam, as tools.encode gives the codes) and scored on every frame
of the held-out utterances for each of its first k levels that make a rung of --kbps (bits per second of audio:
k levels x log2(codebook) bits x the code frame rate, 50 / downsample Hz), as `tools.encode --num_quantizers k` and
`rvq_tokenizer`'s `levels=k` give them (the first k levels of the full search), decoded as `tools.encode decode`:

- rel_mse (models/metrics.py EvalSums, as the trainer's evals), and the lowest level's share of codes in use on
  the held-out code frames (with its ceiling: what an evenly used level would show in that many frames) and on
  every training utterance's codes (a code no training frame takes is dead);
- level 1's PNMI against phone labels (--alignments: a .phn of frame labels, as speech_corpus.py writes them),
  at the code frame rate (models/unit_quality.py, as tools.evaluate scores it).

Beside them, at the same bits per second and 50 Hz: faiss ResidualQuantizer with as many levels of the same
codebook size, beam 1 and beam 8 (quality.py run_faiss; 1 level is plain k-means), trained on every training
frame. Prints a table and writes JSON after each codec; started again with the same --out, a run stopped part-way
goes on where it stopped (the codecs and baselines the report holds are kept). `--valid_dir` scores on another
store's held-out split (one of more utterances of the same kind: `speech_corpus.py --utterances 4000` holds the
400-utterance corpus's utterances first, and ten times its held-out ones). `--plot A.json B.json --out ladder.png`
draws rel_mse against kbps, one panel per report.

    python benchmarks/rate_ladder.py --data_dir .cache/speech_corpus --alignments .cache/speech_corpus/valid.phn \\
        --out benchmarks/results/rate_ladder_speech.json
    python benchmarks/rate_ladder.py --out benchmarks/results/rate_ladder_demo.json                 # demo corpus

The committed reports' commands, the budget in steps and the plot: benchmarks/README.md, "The rate ladder".
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import command_line, machine  # noqa: E402
from benchmarks.quality import all_frames, run_codec, run_faiss, score, stats, unpack_codes  # noqa: E402
from data.alignments import labels_at_code_rate, read_alignments  # noqa: E402
from data.audio.features import FRAME_RATE  # noqa: E402
from data.audio.pass_plan import device_defaults  # noqa: E402
from data.demo_corpus import ensure_demo_corpus  # noqa: E402
from data.stores import open_stores  # noqa: E402
from models.codec import CodecConfig  # noqa: E402
from models.codes import code_dtype, code_frames, decode_utterance  # noqa: E402
from models.unit_quality import unit_quality  # noqa: E402
from rvq_tokenizer.codes_spec import levels_making  # noqa: E402
from training.codec_passes import encode_in_batches  # noqa: E402

# a codec of the ladder: its trainer flags beside the defaults (8 levels x 1024 codes at 50 Hz)
CODECS = {
    "50 Hz x 8 (defaults)": [],
    "25 Hz x 16": ["--downsample", "2", "--num_quantizers", "16"],
    "12.5 Hz x 32": ["--downsample", "4", "--num_quantizers", "32"],
    "50 Hz x 2": ["--num_quantizers", "2"],
    "50 Hz x 4": ["--num_quantizers", "4"],
    "25 Hz x 4": ["--downsample", "2", "--num_quantizers", "4"],
    "25 Hz x 8": ["--downsample", "2", "--num_quantizers", "8"],
    "50 Hz x 8 with quantizer dropout": ["--quantize_dropout"],
    "25 Hz x 8 with dead-code threshold 0.25": ["--downsample", "2", "--dead_code_threshold", "0.25"],
    "25 Hz x 8 with a 320-d latent": ["--downsample", "2", "--latent_dim", "320"],
    "25 Hz x 8 with Muon": ["--downsample", "2", "--optimizer", "muon"],
    "25 Hz x 4 with Muon": ["--downsample", "2", "--num_quantizers", "4", "--optimizer", "muon"],
    "50 Hz x 8 with Muon": ["--optimizer", "muon"],
}
# The trainer's schedule before its defaults became lr 3e-3 decaying to 1% (2026-11-29): every codec above with
# it, by the name its rows made then carry in the committed reports, so that each of them can be run again
BEFORE = ("lr 2e-3 decaying to 10%", ["--lr", "2e-3", "--min_lr_ratio", "0.1"])
CODECS.update({f"{n.removesuffix(' (defaults)')} ({BEFORE[0]})": [*flags, *BEFORE[1]] for n, flags in CODECS.items()})
# run when named, not codecs of the ladder
TRIALS = ("25 Hz x 8 with dead-code threshold 0.25", "25 Hz x 8 with a 320-d latent", "25 Hz x 8 with Muon",
          "25 Hz x 4 with Muon", "50 Hz x 8 with Muon", *[n for n in CODECS if n.endswith(f"({BEFORE[0]})")])
LADDER = [n for n in CODECS if n not in TRIALS]
KBPS = (0.5, 1.0, 2.0, 4.0)


def rungs(levels: int, size: int, downsample: int, kbps: tuple[float, ...]) -> dict[float, int]:
    """kbps -> the levels k (of `levels`) whose codes make that many kilobits per second of audio: what
    `tools.encode --kbps` keeps (rvq_tokenizer.codes_spec levels_making)."""
    found = {rate: levels_making(rate, size, downsample, levels) for rate in kbps}
    return {rate: k for rate, k in found.items() if k is not None}


def phone_labels(path: Path | None, valid) -> list[np.ndarray] | None:
    """The held-out utterances' frame labels from a .phn file (None without one)."""
    if path is None:
        return None
    return read_alignments(path, valid.lengths, None, FRAME_RATE).labels


def level_one_pnmi(codes: list[np.ndarray], labels: list[np.ndarray] | None, downsample: int) -> float | None:
    """PNMI of level 1's codes against the labels at the code frame rate (a code frame takes its first feature
    frame's label, as tools.evaluate scores them)."""
    if labels is None:
        return None
    phones = np.concatenate([labels_at_code_rate(l, downsample)[: len(c)] for l, c in zip(labels, codes)])
    units = np.concatenate([c[: len(labels_at_code_rate(l, downsample)), 0] for l, c in zip(labels, codes)])
    return round(unit_quality(phones, units)["pnmi"], 4)


def usage_per_level(codes: np.ndarray, size: int) -> np.ndarray:
    """Each level's share of its `size` codes that some code frame of `codes` ([frames, levels]) uses."""
    return np.array([len(np.unique(codes[:, q])) / size for q in range(codes.shape[1])])


def even_use_ceiling(frames: int, size: int) -> float:
    """The share of `size` codes that `frames` draws at random from an evenly used codebook are expected to show:
    the most a usage measured on that many code frames can read for a codec with no dead code."""
    return 1 - (1 - 1 / size) ** frames


def score_codec(model, valid, ladder: dict[float, int], labels, train=None) -> list[dict]:
    """Each rung of the trained codec: the codes tools.encode writes of the held-out utterances (every level, its
    own beam, each utterance's tail padded to a code frame), their first k levels decoded as `tools.encode decode`
    decodes them (cut to the utterance's frames), scored on every held-out frame. With `train`, the lowest of the
    first k levels' usage is also counted over the codes of every training utterance: whether a code is dead (no
    frame the codebooks were fit on takes it), free of the held-out count's ceiling (even_use_ceiling)."""
    c = model.config
    batch = device_defaults("cpu").codec_batch_frames
    everything = encode_in_batches(model, valid, c.num_quantizers, batch, code_dtype(c.codebook_size))
    train_usage = None
    if train is not None:
        train_usage = usage_per_level(encode_in_batches(model, train, c.num_quantizers, batch,
                                                        code_dtype(c.codebook_size)), c.codebook_size)
    codes = np.split(everything, np.cumsum(code_frames(valid.lengths, c.downsample))[:-1])
    pnmi = level_one_pnmi(codes, labels, c.downsample)
    out = []
    for rate, k in ladder.items():
        cached = iter(enumerate(codes))

        def reconstruct(x, k=k, cached=cached):
            i, utterance = next(cached)
            kept = np.asarray(utterance[:, :k], dtype=np.int64)
            return torch.from_numpy(decode_utterance(model, kept, int(valid.lengths[i]))), torch.from_numpy(kept)

        with torch.no_grad():
            result = score(valid, reconstruct, k, c.codebook_size)
        row = {"kbps": rate, "levels": k, "rel_mse": result["rel_mse"], "cosine": result["cosine"],
               "lowest_usage": round(min(result["code_usage"]), 4),
               "usage_ceiling": round(even_use_ceiling(len(everything), c.codebook_size), 4), "level_1_pnmi": pnmi}
        if train_usage is not None:
            row["lowest_usage_train"] = round(float(train_usage[:k].min()), 4)
        out.append(row)
    return out


def score_faiss(train_std, valid, mean, std, levels: int, size: int, beam: int, labels) -> dict:
    """faiss ResidualQuantizer of `levels` levels, scored as quality.py scores it, with level 1's PNMI."""
    result = run_faiss(train_std, valid, mean, std, levels, size, beam)
    pnmi = None
    if labels is not None:  # level 1's codes again (run_faiss scores, and keeps no codes)
        import faiss

        rq = faiss.ResidualQuantizer(train_std.shape[1], 1, int(math.log2(size)))
        rq.train(train_std)
        codes = [unpack_codes(rq.compute_codes(((np.asarray(valid.utterance(i)) - mean) / std).astype(np.float32)),
                              1, int(math.log2(size))) for i in range(len(valid))]
        pnmi = level_one_pnmi(codes, labels, 1)
    return {"rel_mse": result["rel_mse"], "cosine": result["cosine"], "lowest_usage": round(min(result["code_usage"]),
            4), "level_1_pnmi": pnmi, "train_seconds": result["train_seconds"]}


def resumed(report: dict, out: Path) -> dict:
    """The report already at `out` when it is of the same corpus, budget and machine (its rows kept, this command
    added to its commands), else `report`: a ladder stopped part-way goes on where it stopped."""
    if not out.exists():
        return report
    old = json.loads(out.read_text())
    same = ("corpus", "budget", "machine", "valid_frames", "train_frames")
    if any(old.get(k) != report[k] for k in same):
        sys.exit(f"{out} holds another ladder ({', '.join(f'{k}={old.get(k)}' for k in same)}): "
                 f"give another --out")
    commands = old.pop("commands", None) or [old.pop("command")]
    return {**old, "commands": [*commands, *report["commands"]]}


def table(report: dict) -> str:
    rows = ["| codes | kbps | rel_mse | x faiss beam 8 | lowest level's usage, held out (its ceiling) | "
            "on training frames | level-1 PNMI | steps |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    beam8 = {r["kbps"]: r["rel_mse"] for r in report["baselines"] if r["beam"] == 8}
    for r in sorted(report["codecs"], key=lambda r: (r["kbps"], r["codec"])):
        ratio = f"{r['rel_mse'] / beam8[r['kbps']]:.2f}" if r["kbps"] in beam8 else ""
        pnmi = "" if r["level_1_pnmi"] is None else f"{r['level_1_pnmi']:.3f}"
        ceiling = f" ({r['usage_ceiling']:.1%})" if "usage_ceiling" in r else ""
        on_train = f"{r['lowest_usage_train']:.1%}" if "lowest_usage_train" in r else ""
        rows.append(f"| {r['codec']}, first {r['levels']} | {r['kbps']:g} | {r['rel_mse']:.5f} | {ratio} | "
                    f"{r['lowest_usage']:.1%}{ceiling} | {on_train} | {pnmi} | {r['steps']:,} |")
    for r in sorted(report["baselines"], key=lambda r: (r["kbps"], r["beam"])):
        pnmi = "" if r["level_1_pnmi"] is None else f"{r['level_1_pnmi']:.3f}"
        rows.append(f"| faiss RQ 50 Hz x {r['levels']}, beam {r['beam']} | {r['kbps']:g} | {r['rel_mse']:.5f} | "
                    f"{r['rel_mse'] / beam8[r['kbps']]:.2f} | {r['lowest_usage']:.1%} | | {pnmi} | |")
    return "\n".join(rows)


def ladder_codec(name: str) -> str:
    """The codec that `name` is, or is with the schedule before (the name of its colour)."""
    base = name.removesuffix(f" ({BEFORE[0]})")
    return name if base == name else next(n for n in CODECS if n.removesuffix(" (defaults)") == base)


def plot(paths: list[Path], out: Path, names: list[str]) -> None:
    """rel_mse against kbps, a panel per report (corpus and budget), two to a row: each codec of `names` that the
    report holds, its rungs joined; faiss dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [json.loads(p.read_text()) for p in paths]
    columns = min(len(reports), 2)
    lines = math.ceil(len(reports) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(6.5 * columns, 4.6 * lines), squeeze=False)
    for ax in axes.flat[len(reports):]:
        ax.set_visible(False)
    for ax, report in zip(axes.flat, reports):
        for name in [n for n in dict.fromkeys(r["codec"] for r in report["codecs"]) if n in names]:
            rows = sorted((r for r in report["codecs"] if r["codec"] == name), key=lambda r: r["kbps"])
            codec = ladder_codec(name)  # a codec's colour the same in every panel, dash-dotted with the old schedule
            ax.plot([r["kbps"] for r in rows], [r["rel_mse"] for r in rows], marker="o", label=name,
                    color=f"C{list(CODECS).index(codec) % 10}", linestyle="-" if name == codec else "-.")
        for beam, style in ((1, ":"), (8, "--")):
            rows = sorted((r for r in report["baselines"] if r["beam"] == beam), key=lambda r: r["kbps"])
            ax.plot([r["kbps"] for r in rows], [r["rel_mse"] for r in rows], "k" + style, marker="x",
                    label=f"faiss RQ 50 Hz, beam {beam}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(KBPS, [f"{k:g}" for k in KBPS])
        ax.set_xlabel("kbps (bits per second of audio / 1000)")
        ax.set_ylabel("rel_mse (held-out frames)")
        ax.set_title(f"{report['corpus']}: each codec {report['budget'].split(' on ')[0]}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", type=Path, help="a feature store with train and valid splits (default: demo corpus)")
    p.add_argument("--valid_dir", type=Path,
                   help="score on this store's held-out split instead of --data_dir's (the codecs and faiss are "
                        "trained on --data_dir's training split): more held-out frames of the same kind")
    p.add_argument("--alignments", type=Path, help="the valid split's frame labels (.phn), for level 1's PNMI")
    p.add_argument("--codecs", default=",".join(LADDER),
                   help=f"comma-separated, of: {'; '.join(CODECS).replace('%', '%%')} (with --plot: the codecs drawn)")
    p.add_argument("--kbps", default=",".join(f"{k:g}" for k in KBPS), help="the rungs, kilobits per second")
    p.add_argument("--max_minutes", type=float, default=10.0, help="each codec's budget, start to exit")
    p.add_argument("--max_steps", type=int, help="each codec's budget in steps instead (the trainer's --max_steps)")
    p.add_argument("--no_baselines", action="store_true", help="leave out faiss (another report of the corpus has it)")
    p.add_argument("--baselines_from", type=Path,
                   help="take the faiss rows from this report of the same corpus (faiss trains to convergence, not "
                        "to a budget) instead of training them again")
    p.add_argument("--plot", type=Path, nargs="+", help="draw these reports into --out (a .png) and stop")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    names = [n for n in args.codecs.split(",") if n]
    unknown = [n for n in names if n not in CODECS]
    if unknown:
        p.error(f"unknown codecs {unknown}: give some of {list(CODECS)}")
    if args.plot:
        plot(args.plot, args.out, names)
        print(f"written {args.out}")
        return 0
    kbps = tuple(float(k) for k in args.kbps.split(","))
    data_dir = args.data_dir or ensure_demo_corpus()
    train, valid, _ = open_stores(data_dir, "train", "valid", seed=0)
    if args.valid_dir:
        _, valid, _ = open_stores(args.valid_dir, "train", "valid", seed=0)
    labels = phone_labels(args.alignments, valid)
    budget = (f"{args.max_steps} steps" if args.max_steps else f"{args.max_minutes:g} minutes") + " on " + machine()
    command = command_line()
    report = {"corpus": "demo" if args.data_dir is None else args.data_dir.name, "budget": budget,
              "machine": machine(), "valid_frames": int(valid.total_frames), "train_frames": int(train.total_frames),
              **({"valid_dir": str(args.valid_dir)} if args.valid_dir else {}),
              "commands": [command], "codecs": [], "baselines": []}
    report = resumed(report, args.out)
    done = {r["codec"] for r in report["codecs"]}
    if done:
        print(f"{args.out}: kept {sorted(done)} and {len(report['baselines'])} baseline rows", file=sys.stderr)

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in names if n not in done]:
            flags = [*CODECS[name], *(["--max_steps", str(args.max_steps)] if args.max_steps else [])]
            began = time.perf_counter()
            trained, model = run_codec(args.data_dir, Path(tmp) / name.replace(" ", "_"),
                                       10_000 if args.max_steps else args.max_minutes, flags, valid)
            c = model.config
            ladder = rungs(c.num_quantizers, c.codebook_size, c.downsample, kbps)
            for row in score_codec(model, valid, ladder, labels, train):
                report["codecs"].append({"codec": name, "flags": flags, "steps": trained["steps"],
                                         "train_seconds": trained["train_seconds"], "threads": trained["threads"],
                                         "dead_code_threshold": c.dead_code_threshold, **row})
            print(f"{name}: {trained['steps']} steps in {time.perf_counter() - began:.0f} s on "
                  f"{trained['threads']} thread(s)", file=sys.stderr)
            write()
    if args.baselines_from:
        other = json.loads(args.baselines_from.read_text())
        if (other["corpus"], other["valid_frames"]) != (report["corpus"], report["valid_frames"]):
            sys.exit(f"{args.baselines_from} is of another corpus ({other['corpus']}, {other['valid_frames']} "
                     f"held-out frames)")
        report["baselines"], report["baselines_from"] = other["baselines"], str(args.baselines_from)
        write()
    elif not args.no_baselines:
        mean, std = stats(train)
        train_std = ((all_frames(train) - mean) / std).astype(np.float32)
        size = CodecConfig(train.dim).codebook_size  # the codecs' (the default)
        scored = {(r["kbps"], r["beam"]) for r in report["baselines"]}
        for rate, k in rungs(64, size, 1, kbps).items():
            for beam in [b for b in (1, 8) if (rate, b) not in scored]:
                row = score_faiss(train_std, valid, mean, std, k, size, beam, labels)
                report["baselines"].append({"kbps": rate, "levels": k, "beam": beam, **row})
                print(f"faiss {k} levels, beam {beam}: rel_mse {row['rel_mse']:.5f}", file=sys.stderr)
                write()
    print(f"{report['corpus']}, {budget}; {report['valid_frames']} held-out frames\n")
    print(table(report))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
