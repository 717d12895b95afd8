"""Codec quality at a fixed bitrate: our trained codec against residual k-means and a bare ResidualVQ.

On one feature store (the demo corpus when --data_dir is absent), with the same
levels and codebook size for every method (default 8 x 1024, 80 bits/frame):

- codec: the trainer run as a subprocess with its defaults and --max_minutes alone
  (the whole run's time, start to exit; extra flags after -- make a named extra
  row), then models.codec loaded from the last checkpoint, scored through encode and decode
  as tools.encode gives its codes (the codec's beam search); with --encode_beams, the same
  codec again with a beam search that wide (1: the nearest code at each level);
- faiss ResidualQuantizer, beam 1 and beam 8 (`rq.max_beam_size`), trained on
  every training frame (the frames the codec trains on), standardised per
  dimension with the codec's own statistics; reconstructions are mapped back;
- vector-quantize-pytorch's ResidualVQ alone (no encoder/decoder, same library
  options as the codec's quantizer) on the standardised features, fed the
  trainer's batches (same batch plan, seed and number of steps).

Every method is scored with models/metrics.py EvalSums on every frame of the
held-out utterances (whole utterances, not crops): rel_mse, cosine, code usage,
perplexity, bits per frame; plus the wall time to train. Prints a markdown table
and writes JSON.

    python benchmarks/quality.py [--data_dir DIR] [--out benchmarks/results/quality_demo.json] \\
        [--max_minutes 10] [--encode_beams 1] [-- extra trainer flags]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import command_line, machine  # noqa: E402
from data.batch_plan import BatchPlan  # noqa: E402
from data.crops import HostBatches  # noqa: E402
from data.demo_corpus import ensure_demo_corpus  # noqa: E402
from data.stores import open_stores  # noqa: E402
from models.codec import CodecConfig, RVQCodec  # noqa: E402
from models.metrics import EvalSums  # noqa: E402
from training.metrics_log import run_events  # noqa: E402
from training.run_folder import RunFolder  # noqa: E402
from training import checkpoint as ckpt  # noqa: E402
from training.codebooks import feature_stats  # noqa: E402
from training.config import parse_args  # noqa: E402
from training.device import select_device  # noqa: E402

TRAINER = REPO / "rvq_seamless_gpu_cache_nccl.py"


def stats(store, max_utterances: int = 256):
    """The codec's standardisation, computed exactly as the trainer does."""
    mean, std = feature_stats(store, max_utterances)
    return mean.numpy(), std.clamp_min(1e-5).numpy()


def all_frames(store) -> np.ndarray:
    return np.concatenate([store.utterance(i) for i in range(len(store))]).astype(np.float32)


def score(valid, reconstruct, levels: int, size: int, each=None) -> dict:
    """EvalSums over every held-out frame; reconstruct(utterance [T, D]) -> (x_hat [T, D], codes [T, Q]);
    each(x, x_hat), if given, sees every utterance's frames and their reconstruction."""
    sums = EvalSums(valid.dim, levels, size, "cpu")
    for i in range(len(valid)):
        x = torch.from_numpy(np.array(valid.utterance(i), dtype=np.float32))  # a writable copy
        x_hat, codes = reconstruct(x)
        x = x[: len(x_hat)]  # a codec of --downsample s codes the first multiple of s frames
        sums.add(x, x_hat, codes)
        if each is not None:
            each(x, x_hat)
    return sums.result(downsample=1)


# ---------------------------------------------------------------- (a) our codec


def finished_run(out_dir: Path) -> tuple[dict, float, dict, RVQCodec]:
    """A stopped trainer run: (its last stop event, the seconds from its first metrics event to that stop, its last
    checkpoint, the codec of that checkpoint in eval mode)."""
    events = run_events(out_dir)
    stops = [e for e in events if e["event"] == "stop"]
    if not stops:
        sys.exit(f"{out_dir}: the run has not stopped (no stop event in its metrics.jsonl)")
    _, state = ckpt.load_latest(RunFolder(out_dir).checkpoints)
    model = RVQCodec(CodecConfig(**state["codec"]))
    model.load_state_dict(state["model"])
    return stops[-1], stops[-1]["time"] - events[0]["time"], state, model.eval()


def run_codec(data_dir, out_dir: Path, max_minutes: float, extra: list[str], valid) -> tuple[dict, RVQCodec]:
    """Train with the defaults and `extra` flags; (what the run did, the codec from its last checkpoint)."""
    cmd = [sys.executable, str(TRAINER), "--output_dir", str(out_dir), "--resume", "none",
           "--max_minutes", str(max_minutes), *extra]
    if data_dir:
        cmd += ["--data_dir", str(data_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        sys.exit(f"the trainer failed ({run.returncode}):\n{run.stderr[-3000:]}")
    stop, train_seconds, state, model = finished_run(out_dir)
    if len(valid.utterance(0)) % model.config.downsample:
        print(f"note: utterances are cut to a multiple of downsample {model.config.downsample}", file=sys.stderr)
    trained = dict(train_seconds=round(seconds, 1), trainer_seconds=round(train_seconds, 1), steps=stop["step"],
                   threads=state.get("threads"), stop_reason=stop["reason"], codec=state["codec"],
                   command=" ".join(cmd[1:]), trainer_flags=extra)
    return trained, model


def score_encoded(model: RVQCodec, valid, beam: int, trained: dict, each=None) -> dict:
    """The trained codec scored through encode and decode, as tools.encode --beam_size BEAM gives its codes (each:
    see `score`)."""
    c = model.config

    def reconstruct(x):
        codes = model.encode(x[: len(x) // c.downsample * c.downsample], beam_size=beam)
        return model.decode(codes), codes

    start = time.perf_counter()
    with torch.no_grad():
        result = score(valid, reconstruct, c.num_quantizers, c.codebook_size, each)
    seconds = time.perf_counter() - start
    how = "the nearest code at each level" if beam == 1 else f"a beam search {beam} wide"
    result.update(trained, method=f"codec (ours), codes from {how}", beam_size=beam,
                  bits_per_frame=c.num_quantizers * np.log2(c.codebook_size) / c.downsample,
                  encode_seconds=round(seconds, 1), encode_frames=int(valid.total_frames))
    return result


# ---------------------------------------------------------------- (b) faiss residual k-means


def unpack_codes(packed: np.ndarray, levels: int, nbits: int) -> np.ndarray:
    """faiss packs codes LSB-first, nbits each; -> [N, levels] int64."""
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, : levels * nbits].reshape(len(packed), levels, nbits)
    return (bits.astype(np.int64) << np.arange(nbits)).sum(-1)


def run_faiss(train_std: np.ndarray, valid, mean, std, levels: int, size: int, beam: int) -> dict:
    import faiss

    nbits = int(np.log2(size))
    rq = faiss.ResidualQuantizer(train_std.shape[1], levels, nbits)
    rq.max_beam_size = beam
    start = time.perf_counter()
    rq.train(train_std)
    seconds = time.perf_counter() - start

    def reconstruct(x):
        xs = ((x.numpy() - mean) / std).astype(np.float32)
        packed = rq.compute_codes(xs)
        x_hat = rq.decode(packed) * std + mean
        return torch.from_numpy(x_hat), torch.from_numpy(unpack_codes(packed, levels, nbits))

    result = score(valid, reconstruct, levels, size)
    result.update(method=f"faiss ResidualQuantizer, beam {beam}", train_seconds=round(seconds, 1),
                  train_frames=len(train_std), faiss_version=faiss.__version__)
    return result


# ---------------------------------------------------------------- (c) bare ResidualVQ


def run_bare_rvq(train, valid, mean, std, codec: dict, trainer_cfg, steps: int) -> dict:
    from vector_quantize_pytorch import ResidualVQ

    torch.manual_seed(trainer_cfg.optim.seed)
    rvq = ResidualVQ(dim=train.dim, num_quantizers=codec["num_quantizers"], codebook_size=codec["codebook_size"],
                     kmeans_init=codec["kmeans_init"], kmeans_iters=codec["kmeans_iters"], decay=codec["ema_decay"],
                     threshold_ema_dead_code=codec["dead_code_threshold"], rotation_trick=False)
    lengths = [trainer_cfg.data.segment_length]
    plan = BatchPlan(train.lengths, segment_lengths=lengths, frames_per_step=trainer_cfg.data.frames_per_step,
                     seed=trainer_cfg.optim.seed, rank=0, world_size=1)
    batches = HostBatches(train, plan, torch.device("cpu"))
    m, s = torch.from_numpy(mean), torch.from_numpy(std)
    rvq.train()
    start = time.perf_counter()
    with torch.no_grad():  # no parameters: the EMA codebooks learn in the forward pass
        for step in range(steps):
            _, x = batches.get(step)
            rvq((x - m) / s)
    seconds = time.perf_counter() - start
    batches.close()
    rvq.eval()

    def reconstruct(x):
        q, codes, _ = rvq(((x - m) / s)[None])
        return q[0] * s + m, codes[0]

    with torch.no_grad():
        result = score(valid, reconstruct, codec["num_quantizers"], codec["codebook_size"])
    result.update(method="vector-quantize-pytorch ResidualVQ (no encoder/decoder)", train_seconds=round(seconds, 1),
                  steps=steps, frames_per_step=trainer_cfg.data.frames_per_step)
    return result


# ---------------------------------------------------------------- report


def table(results: list[dict]) -> str:
    rows = ["| method | rel_mse | cosine | min / mean code usage | min perplexity | bits/frame | train time |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        u = r["code_usage"]
        rows.append(f"| {r['method']} | {r['rel_mse']:.5f} | {r['cosine']:.5f} | {min(u):.1%} / {np.mean(u):.1%} | "
                    f"{min(r['perplexity']):.0f} | {r['bits_per_frame']:.0f} | {r['train_seconds'] / 60:.1f} min |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=None, help="fairseq dump with train and valid splits; none: demo corpus")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/quality_<corpus>.json)")
    parser.add_argument("--max_minutes", type=float, default=10.0,
                        help="the codec's budget, start to exit (the trainer's --max_minutes)")
    parser.add_argument("--valid_dir", default=None,
                        help="score on this store's held-out split instead of --data_dir's (the same held-out "
                             "frames for runs on corpora of different sizes)")
    parser.add_argument("--methods", default="codec,faiss1,rvq,faiss8", help="run in this order")
    parser.add_argument("--encode_beams", type=lambda text: [int(b) for b in text.split(",") if b], default=[1],
                        help="extra rows for the trained codec: its codes from a beam search this wide "
                             "(tools.encode --beam_size; 1: the nearest code at each level), comma-separated; "
                             "empty: none. The codec's row has the codes of its own --beam_size")
    parser.add_argument("--faiss_space", choices=("standardised", "raw"), default="standardised",
                        help="what faiss is trained on: the codec's standardised features, or the raw ones")
    parser.add_argument("--codec_dir", default=None, help="keep the trainer's run here (default: a temporary dir)")
    parser.add_argument("trainer_flags", nargs="*", help="after --: extra trainer flags for the codec")
    args = parser.parse_args()
    methods = args.methods.split(",")
    corpus = "demo" if args.data_dir is None else Path(args.data_dir).name
    out = Path(args.out or REPO / "benchmarks" / "results" / f"quality_{corpus}.json")
    trainer_cfg = parse_args(args.trainer_flags)
    train, valid, note = open_stores(args.data_dir or ensure_demo_corpus(), trainer_cfg.data.train_split,
                                     trainer_cfg.data.valid_split, seed=trainer_cfg.optim.seed)
    if note:
        print(note, file=sys.stderr)
    if args.valid_dir:
        _, valid, _ = open_stores(args.valid_dir, trainer_cfg.data.train_split, trainer_cfg.data.valid_split,
                                  seed=trainer_cfg.optim.seed)
    device_type = select_device(trainer_cfg.run.device).type  # the trainer's, for its default batch
    trainer_cfg.data = trainer_cfg.data.fit_to(train.lengths, trainer_cfg.codec["downsample"], device_type)
    mean, std = stats(train)
    levels, size = trainer_cfg.codec["num_quantizers"], trainer_cfg.codec["codebook_size"]
    load = open("/proc/loadavg").read().split()[:3]
    results = []

    def write_report() -> None:  # after every method, so that a cut-short run keeps what it measured
        load_after = open("/proc/loadavg").read().split()[:3]
        report = {"corpus": corpus, "data_dir": args.data_dir or "demo corpus (data/demo_corpus.py)",
                  "valid_dir": args.valid_dir or args.data_dir or "demo corpus (data/demo_corpus.py)",
                  "machine": machine(), "loadavg_before": load, "loadavg_after": load_after,
                  "train_utterances": len(train), "train_frames": int(train.total_frames),
                  "valid_utterances": len(valid), "valid_frames": int(valid.total_frames),
                  "levels": levels, "codebook_size": size,
                  "standardisation": f"per-dimension mean/std of the training data (the codec's own); faiss on "
                                     f"{args.faiss_space} features, the bare ResidualVQ on standardised ones; "
                                     "reconstructions are mapped back to feature space for the metric",
                  "command": command_line(), "results": results}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    f_mean, f_std = (mean, std) if args.faiss_space == "standardised" else (0 * mean, 0 * std + 1)
    codec = CodecConfig(train.dim).to_dict()
    steps = trainer_cfg.optim.max_steps  # the bare ResidualVQ gets the codec's step budget (or the steps it ran)
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            first = len(results)
            if method == "codec":
                trained, model = run_codec(args.data_dir, Path(args.codec_dir or tmp), args.max_minutes,
                                           args.trainer_flags, valid)
                codec, steps = trained["codec"], trained["steps"]
                # the codec's own codes (its --beam_size, as tools.encode), then each --encode_beams width
                results.append({**score_encoded(model, valid, model.config.beam_size, trained),
                                "method": "codec (ours)"})
                results += [score_encoded(model, valid, beam, trained) for beam in args.encode_beams]
            elif method in ("faiss1", "faiss8"):
                train_std = ((all_frames(train) - f_mean) / f_std).astype(np.float32)
                results.append(run_faiss(train_std, valid, f_mean, f_std, levels, size, int(method[5:])))
                results[-1]["space"] = args.faiss_space
            elif method == "rvq":
                if steps is None:
                    sys.exit("the bare ResidualVQ trains for the codec's steps: run the codec first, or pass "
                             "-- --max_steps N")
                results.append(run_bare_rvq(train, valid, mean, std, codec, trainer_cfg, steps))
            else:
                sys.exit(f"unknown method {method!r}: codec, faiss1, faiss8, rvq")
            print(table(results[first:]), file=sys.stderr)
            write_report()
    print(f"{corpus}: {len(train)} train utterances ({train.total_frames} frames), {len(valid)} held out "
          f"({valid.total_frames} frames); {machine()}; load {' '.join(load)}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
