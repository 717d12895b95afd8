"""Whether an utterance's codes depend on the company it is encoded in: the share of its code frames that differ
from its codes alone, in a list, in the list reversed, beside a long stranger, and under other window and pass
sizes (--commit_seconds, --batch_seconds), each as the tools compute them (rvq_tokenizer's codec over audio, the
tools' pipeline and passes).

Why it is measured: w2v-BERT's passes hold several utterances' chunks, and a matrix product's last bits can change
with the shape of the batch it is part of (on a GPU in bf16 above all); a code picked at a near tie then changes.
The peers' users report 5.8% of codes differing between batched and single inference. On a CPU in float32 the
codes were the same in any company (tests/test_codes_in_company.py keeps that); on a GPU this script says how many
differ, the figure the docs give per device.

A generated corpus (bench_extract.py's mix: tones and chirps at 16, 22.05 and 44.1 kHz, a third stereo) of --files
utterances of --seconds, and a stranger of --stranger_seconds; a random w2v-BERT (bench_tokenize.py's configs) to
--layer at --precision, and an untrained default-sized codec (8 levels x 1024 codes) recording the features of a
short tools.extract run with the same model and precision (the codes of an untrained codec near-tie no more
often than a trained one's: its codebooks are random draws of its features).

    python benchmarks/codes_in_company.py [--device cuda] [--model w2v-bert-2.0] [--layer 17] [--precision bf16]
        [--files 32] [--seconds 2,20] [--out benchmarks/results/codes_in_company.json]
    python benchmarks/codes_in_company.py --cpu-only [--batched]   # the small model on this CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
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


def codec_for(tmp: Path, audio: Path, model: Path, layer: int, device: str, precision: str) -> Path:
    """An untrained default-sized codec recording the features tools.extract makes with this model, layer and
    precision of the corpus's first files."""
    from tests.audio_helpers import random_codec

    sample, feats = tmp / "sample", tmp / "feats"
    sample.mkdir()
    for path in sorted(audio.iterdir())[:2]:
        (sample / path.name).write_bytes(path.read_bytes())
    done = subprocess.run([sys.executable, "-m", "tools.extract", str(sample), "train", "1", "0", str(feats),
                           "--feature", "w2v-bert", "--checkpoint", str(model), "--layer", str(layer), "--device",
                           device, "--precision", precision], cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"tools.extract failed:\n{done.stderr[-3000:]}")
    dim = int(np.load(feats / "train_0_1.npy", mmap_mode="r").shape[1])
    return random_codec(tmp / "codec.pt", feats, feature_dim=dim, latent_dim=160, num_quantizers=8,
                        codebook_size=1024)


def tokenizer_with(codec_path: Path, device: str, **pipeline):
    """rvq_tokenizer's tokenizer of the codec, its pipeline's window and pass sizes set as the tools' flags set
    them (None: the device's defaults)."""
    import torch

    from errors import PYTHON
    from rvq_tokenizer.audio_codec import audio_codec
    from rvq_tokenizer.codec_files import load_codec
    from rvq_tokenizer.codes_spec import CodesRequest
    from rvq_tokenizer.pipeline_settings import default_pipeline
    from rvq_tokenizer.tokenizer import RVQTokenizer
    from rvq_tokenizer.trained_features import FeatureFlags

    where = torch.device(device)
    model, state, path = load_codec(codec_path, where)
    settings = dataclasses.replace(default_pipeline(device), **{k: v for k, v in pipeline.items() if v is not None})
    codec = audio_codec(model, state, path, CodesRequest(None, None, None, None, False),
                        FeatureFlags(None, None, None, None, asker=PYTHON), settings, where, recorded=None)
    return RVQTokenizer(codec)


def differing(alone: list[np.ndarray], other: list[np.ndarray]) -> dict:
    """The share of code frames (any level) and of level-1 codes that differ, over every utterance."""
    frames = sum(len(a) for a in alone)
    rows = sum(int((a != b).any(axis=1).sum()) for a, b in zip(alone, other, strict=True))
    first = sum(int((a[:, 0] != b[:, 0]).sum()) for a, b in zip(alone, other, strict=True))
    utterances = sum(int(not np.array_equal(a, b)) for a, b in zip(alone, other, strict=True))
    return {"code_frames": frames, "frames_differing": rows, "share_of_frames": round(rows / frames, 6),
            "level_1_differing": first, "utterances_differing": utterances}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="bench_tokenize.py's MODELS (default: small on a CPU, w2v-bert-2.0 "
                                                 "on a GPU)")
    p.add_argument("--layer", type=int, help="default: the model's DEFAULT_LAYER")
    p.add_argument("--precision", default=None, help="fp32 or bf16 (default: fp32 on a CPU, bf16 on a GPU)")
    p.add_argument("--files", type=int, default=32)
    p.add_argument("--seconds", default="2,20", help="the utterances' durations, uniform between these")
    p.add_argument("--stranger_seconds", type=float, default=20.0)
    p.add_argument("--cpu-only", action="store_true", help="the small model on this CPU, 8 files of 1-4 s")
    p.add_argument("--batched", action="store_true",
                   help="on a CPU, passes of many chunks (least_cost_passes, a GPU's rule), as the tools made them "
                        "there before each chunk went alone: the comparison")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "codes_in_company.json")
    args = p.parse_args()
    if args.cpu_only:
        args.device, args.files, args.seconds, args.stranger_seconds = "cpu", 8, "1,4", 6.0
    gpu = args.device.startswith("cuda")
    model_name = args.model or ("w2v-bert-2.0" if gpu else "small")
    layer = args.layer or DEFAULT_LAYER[model_name]
    precision = args.precision or ("bf16" if gpu else "fp32")
    low, high = map(float, args.seconds.split(","))
    if args.batched:
        from data.audio import pass_plan

        pass_plan.DEVICE_DEFAULTS["cpu"] = dataclasses.replace(pass_plan.DEVICE_DEFAULTS["cpu"], chunks_alone=False)
    import soundfile as sf

    from tests.audio_helpers import voice_like

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "audio").mkdir()
        write_corpus(tmp / "audio", args.files, (low, high))
        save_model(tmp / "model", model_name)
        codec = codec_for(tmp, tmp / "audio", tmp / "model", layer, args.device, precision)
        read = [sf.read(p, dtype="float32") for p in sorted((tmp / "audio").iterdir())]
        waves, rates = [w for w, _ in read], [r for _, r in read]
        stranger = voice_like(args.stranger_seconds, 16000, seed=10_000).astype(np.float32)
        tokenizer = tokenizer_with(codec, args.device)
        began = time.perf_counter()
        alone = [tokenizer.encode(w, r) for w, r in zip(waves, rates)]
        seconds_alone = time.perf_counter() - began
        defaults = tokenizer._codec.pipeline
        companies = {
            "in a list": lambda t: t.encode(waves, rates),
            "in the list reversed": lambda t: t.encode(waves[::-1], rates[::-1])[::-1],
            "beside a long stranger": lambda t: t.encode([stranger, *waves], [16000, *rates])[1:],
        }
        results = {name: differing(alone, run(tokenizer)) for name, run in companies.items()}
        for name, settings in (("windows of a quarter", {"commit_seconds": defaults.commit_seconds / 4}),
                               ("passes of a quarter", {"batch_seconds": defaults.batch_seconds_on(
                                   tokenizer.device) / 4})):
            other = tokenizer_with(codec, args.device, **settings)
            results[f"{name} ({', '.join(f'--{k} {v:g}' for k, v in settings.items())})"] = differing(
                alone, other.encode(waves, rates))
    audio = sum(len(w) / r for w, r in zip(waves, rates))
    out = {"machine": machine(), "device": args.device, "model": model_name, "layer": layer, "precision": precision,
           "files": args.files, "audio_seconds": round(audio, 1), "stranger_seconds": args.stranger_seconds,
           "passes": tokenizer.info.settings.get("passes"),
           "seconds_encoding_each_alone": round(seconds_alone, 2), "attention": tokenizer.info.settings.get(
               "attention"), "companies": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['machine']}; {args.device}, {model_name} to layer {layer} in {precision}, attention "
          f"{out['attention']}, passes: {out['passes']}; {args.files} utterances, {audio:.0f} s of audio")
    print("| company | code frames differing from the utterance alone | share | level-1 codes | utterances |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['frames_differing']} of {r['code_frames']} | {r['share_of_frames']:.4%} | "
              f"{r['level_1_differing']} | {r['utterances_differing']} of {args.files} |")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
