"""The trainer's flags: each default lives here and only here, but the codec's, which are
CodecConfig's (models/codec.py) so that the trainer and code that builds a codec directly agree.

A bad flag or value ends in argparse's message and exit code 2.
`--local_rank` and `--local-rank` are both accepted, for the older
`torch.distributed.launch`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from models.codec import CodecConfig

CODEC = {f.name: f.default for f in dataclasses.fields(CodecConfig) if f.default is not dataclasses.MISSING}


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, got {text!r}")
    return sorted(set(values))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected zero or more, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def on_off(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rvq_seamless_gpu_cache_nccl.py",
        description="Train a residual vector quantizer on SeamlessM4T features, on one process or many.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--data_dir", default=None,
                   help="feature store (fairseq dump or folder of [T, D] .npy/.pt); none: the built-in demo corpus")
    g.add_argument("--train_split", default="train")
    g.add_argument("--valid_split", default="valid", help="when absent, 2%% of training utterances are held out")
    g.add_argument("--batch_size", type=positive_int, default=64,
                   help="crops per rank per step at --segment_length; frames per step stay this x that")
    g.add_argument("--segment_length", type=positive_int, default=128, help="frames per crop (the base length)")
    g.add_argument("--multi_length_training", action="store_true", help="draw each step's length from --segment_lengths")
    g.add_argument("--segment_lengths", type=int_list, default=[64, 128, 256, 512])
    g.add_argument("--num_workers", type=nonnegative_int, default=0,
                   help="background threads assembling batches (0: on the main thread unless --prefetch)")
    g.add_argument("--pin_memory", nargs="?", const=True, default=False, type=on_off)
    g.add_argument("--persistent_workers", nargs="?", const=True, default=False, type=on_off,
                   help="keep the worker threads across epochs instead of starting them anew")
    g.add_argument("--use_gpu_cache", action="store_true", help="pack this rank's features into one device tensor")
    g.add_argument("--gpu_cache_gb", type=positive_float, default=8.0, help="device cache budget per rank")
    g.add_argument("--prefetch", action="store_true", help="assemble batches ahead in a background thread")
    g.add_argument("--prefetch_depth", type=positive_int, default=4)

    g = p.add_argument_group("codec")
    g.add_argument("--num_quantizers", type=positive_int, default=CODEC["num_quantizers"])
    g.add_argument("--codebook_size", type=positive_int, default=CODEC["codebook_size"])
    g.add_argument("--codebook_dim", type=positive_int, default=CODEC["codebook_dim"], help="none: the latent dim (no projection)")
    g.add_argument("--latent_dim", type=positive_int, default=CODEC["latent_dim"])
    g.add_argument("--encoder_blocks", type=positive_int, default=CODEC["encoder_blocks"],
                   help="residual conv blocks in the encoder and in the decoder each")
    g.add_argument("--downsample", type=int, choices=(1, 2, 4), default=CODEC["downsample"])
    g.add_argument("--kmeans_init", nargs="?", const=True, default=CODEC["kmeans_init"], type=on_off)
    g.add_argument("--kmeans_init_frames", type=nonnegative_int, default=16384,
                   help="frames per rank for the k-means init of the codebooks, before the first step "
                        "(0: k-means on the first training batch)")
    g.add_argument("--dead_code_threshold", type=float, default=CODEC["dead_code_threshold"],
                   help="re-seed a code whose EMA count of frames per step falls below this")
    g.add_argument("--refit_iters", type=nonnegative_int, default=2,
                   help="when the schedule ends (steps, epochs or --max_minutes), Lloyd's k-means iterations on "
                        "every level over whole training utterances, before the final eval (0: no refit)")
    g.add_argument("--refit_frames", type=positive_int, default=262144,
                   help="frames per rank for the refit: whole utterances drawn at random up to this many")
    g.add_argument("--ema_decay", type=float, default=CODEC["ema_decay"])
    g.add_argument("--quantize_dropout", action="store_true", help="train for variable bitrate (fewer levels)")
    g.add_argument("--commitment_weight", type=float, default=CODEC["commitment_weight"])
    g.add_argument("--recon_space", choices=("feature", "standardised"), default=CODEC["recon_space"],
                   help="reconstruction MSE in feature space (each dim weighted by its variance, as rel_mse "
                        "counts errors) or on the standardised features (every dim alike)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--max_steps", type=positive_int, default=None, help="none: --epochs decides")
    g.add_argument("--max_minutes", type=positive_float, default=None,
                   help="stop after this many minutes of training, with the codebook refit, the final eval and "
                        "checkpoint (on several ranks rank 0's clock decides, at a sync check)")
    g.add_argument("--epochs", type=positive_int, default=10)
    g.add_argument("--grad_accum", type=positive_int, default=1,
                   help="micro-batches per step; gradients are all-reduced on the last one only")
    g.add_argument("--lr", type=positive_float, default=2e-3)
    g.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine decay ends at lr x this")
    g.add_argument("--warmup_steps", type=int, default=50)
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--grad_clip", type=float, default=1.0, help="0: no clipping")
    g.add_argument("--max_bad_steps", type=nonnegative_int, default=10,
                   help="non-finite steps in a row (each skipped on every rank) before the run stops")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: bf16 on a GPU that supports it, else fp32")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("run")
    g.add_argument("--output_dir", default="runs/default")
    g.add_argument("--eval_every", type=positive_int, default=100)
    g.add_argument("--save_every", type=positive_int, default=200)
    g.add_argument("--keep_checkpoints", type=positive_int, default=3)
    g.add_argument("--log_every", type=positive_int, default=10)
    g.add_argument("--resume", default="auto", help="auto (last checkpoint in --output_dir), none, or a path")
    g.add_argument("--tensorboard", action="store_true",
                   help="also write the metrics as TensorBoard scalars to OUTPUT_DIR/tensorboard (pip install tensorboard)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, or cuda:N (single process)")

    g = p.add_argument_group("distributed")
    g.add_argument("--nccl_timeout", type=positive_int, default=None,
                   help="process-group timeout in seconds (default 1800, or $NCCL_TIMEOUT)")
    g.add_argument("--sync_check_every", type=positive_int, default=50, help="steps between cross-rank sync checks")
    g.add_argument("--sync_timeout", type=positive_int, default=300,
                   help="seconds a sync check waits for a silent rank before every rank stops")
    g.add_argument("--slow_phase_timeout", type=positive_int, default=None,
                   help="process-group timeout in seconds for the first step (k-means init) and eval; "
                        "default twice --nccl_timeout")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


DEFAULT_NCCL_TIMEOUT = 1800


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.nccl_timeout is None:
        env = os.environ.get("NCCL_TIMEOUT")
        if env is not None:
            try:
                args.nccl_timeout = positive_int(env)
            except argparse.ArgumentTypeError as e:
                parser.error(f"NCCL_TIMEOUT={env!r}: {e}")
        else:
            args.nccl_timeout = DEFAULT_NCCL_TIMEOUT
    if args.downsample > 1:
        lengths = args.segment_lengths if args.multi_length_training else [args.segment_length]
        bad = [L for L in lengths if L % args.downsample]
        if bad:
            parser.error(f"segment length(s) {bad} are not multiples of --downsample {args.downsample}")
    if args.resume not in ("auto", "none") and not os.path.exists(args.resume):
        parser.error(f"--resume {args.resume}: no such checkpoint")
    return args


def train_lengths(args) -> list[int]:
    return list(args.segment_lengths) if args.multi_length_training else [args.segment_length]


def save_config(args, path) -> None:
    config = {k: v for k, v in vars(args).items() if k != "local_rank"}
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
