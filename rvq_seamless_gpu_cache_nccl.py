#!/usr/bin/env python3
"""Train a multi-length residual vector quantizer (RVQ) on SeamlessM4T features.

One process (`python rvq_seamless_gpu_cache_nccl.py ...`) or many (`torchrun`,
`python -m torch.distributed.launch`, `accelerate launch`, `srun`). Read top to
bottom: flags -> data -> process group -> model -> resume -> the loop -> teardown.
The machinery lives in data/, models/ and training/.

Exit codes: 0 done or stopped on request (checkpoint written); 2 bad flags or
data (nothing written); 3 a distributed failure (the rank is named); 1 anything else.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from data.batch_plan import BatchPlan, eval_windows, shard_indices
from data.crops import HostBatches, assemble_crops
from data.demo_corpus import ensure_demo_corpus
from data.device_cache import DeviceFeatureCache
from data.prefetcher import Prefetcher
from data.stores import FeatureStore, check_finite, open_stores
from models.codec import CodecConfig, RVQCodec, codebook_tensors, dead_code_counts
from models.metrics import EvalSums
from training import checkpoint as ckpt
from training.config import parse_args, save_config, train_lengths
from training.distributed import (DistContext, all_reduce_sum, destroy, detect_launch, init_distributed,
                                  final_barrier, is_distributed_error, phase_timeout, wrap_ddp)
from training.device import compute_dtype, half_dtype, select_device
from errors import EXIT_FAILURE, EXIT_OK, BadInputError, DistributedFailure
from training.metrics_log import MetricsLog, require_tensorboard
from training.signals import StopRequest
from training.faults import FaultInjector
from training.sync_check import exchange, sync_check
from training.throughput import start_step_timer
from training.watchdog import PeerWatchdog

log = logging.getLogger("rvq")
LOW_USAGE = 0.2  # an eval warns when a level uses less than this share of its codes on held-out data


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    from loguru import logger  # vector-quantize-pytorch logs through loguru

    logger.remove()
    logger.add(sys.stderr, level="ERROR")


def feature_stats(store, max_utterances: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std over evenly spaced training utterances (the same on every rank)."""
    picks = sorted(set(int(i) for i in torch.linspace(0, len(store) - 1, min(len(store), max_utterances))))
    frames = torch.cat([torch.from_numpy(store.utterance(i).astype("float64")) for i in picks])
    return frames.mean(0).float(), frames.std(0).float()


def kmeans_sample(store, frames: int, length: int, seed: int) -> torch.Tensor:
    """Random crops of `length` frames from this rank's utterances, about `frames` frames in all."""
    rng = torch.Generator().manual_seed(seed)
    long_enough = [i for i, n in enumerate(store.lengths) if n >= length]
    picks = [long_enough[int(j)] for j in torch.randint(len(long_enough), (max(1, frames // length),), generator=rng)]
    starts = [int(torch.randint(int(store.lengths[i]) - length + 1, (1,), generator=rng)) for i in picks]
    return torch.from_numpy(assemble_crops(store, picks, starts, length))


def refit_utterances(store, frames: int, seed: int) -> list[torch.Tensor]:
    """Whole utterances of this rank's shard in a random order, up to about `frames` frames."""
    order = torch.randperm(len(store), generator=torch.Generator().manual_seed(seed)).tolist()
    picked, total = [], 0
    for i in order:
        if total >= frames:
            break
        picked.append(torch.from_numpy(store.utterance(i).astype("float32")))
        total += len(picked[-1])
    return picked


def refit(model: RVQCodec, store, ctx: DistContext, args, metrics, step: int, device) -> None:
    """The codebooks' last pass: Lloyd's k-means over whole utterances of every rank (all ranks together)."""
    start = time.perf_counter()
    utterances = [u.to(device) for u in refit_utterances(store, args.refit_frames, args.seed + 7919 + ctx.rank)]
    model.eval()  # no EMA update in the passes the refit makes
    try:
        errors = model.refit_codebooks(utterances, args.refit_iters, batch_frames=args.batch_size * args.segment_length,
                                       all_reduce=lambda t: all_reduce_sum(ctx, t), seed=args.seed)
    finally:
        model.train()
    seconds = time.perf_counter() - start
    frames = sum(len(u) for u in utterances)
    metrics.write("refit", step, frames_per_rank=frames, iters=args.refit_iters, residual_mse=errors,
                  seconds=round(seconds, 1))
    log.info("codebooks: refit with %d k-means iteration(s) per level on %d frames per rank in %.1f s; residual "
             "MSE after each level %s", args.refit_iters, frames, seconds, [f"{e:.3g}" for e in errors])


def learning_rate(step: int, args, total_steps: int) -> float:
    """Linear warmup, then cosine decay to lr x min_lr_ratio."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_batches(args, store, plan, device, start_step: int, show_progress: bool):
    prefetch = dict(start_step=start_step, depth=args.prefetch_depth, workers=args.num_workers,
                    pin_memory=args.pin_memory, persistent_workers=args.persistent_workers)
    streaming = args.prefetch or args.num_workers > 0
    if args.use_gpu_cache:  # with --prefetch, what does not fit under --gpu_cache_gb is prefetched
        # on a CPU the cache is RAM, and converting half precision would cost 4x the gather itself
        cache_dtype = torch.float32 if device.type == "cpu" else half_dtype(device)
        return DeviceFeatureCache(store, plan, device, max_bytes=args.gpu_cache_gb * 1e9, dtype=cache_dtype,
                                  show_progress=show_progress, stream=prefetch if streaming else None)
    if streaming:
        return Prefetcher(store, plan, device, **prefetch)
    return HostBatches(store, plan, device, pin_memory=args.pin_memory)


@torch.no_grad()
def evaluate_shard(model: RVQCodec, store, windows, device, args, amp_dtype) -> EvalSums:
    """Sums over this rank's held-out windows; no collectives, so a failure here cannot hang a peer."""
    utterances, starts, length = windows
    sums = EvalSums(model.config.feature_dim, model.config.num_quantizers, model.config.codebook_size, device)
    per_batch = max(1, args.batch_size * args.segment_length // length)
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for i in range(0, len(utterances), per_batch):
                x = torch.from_numpy(assemble_crops(store, utterances[i : i + per_batch], starts[i : i + per_batch],
                                                    length)).to(device)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    out = model(x)
                sums.add(x, out.reconstruction.float(), out.codes)
    finally:
        model.train()
    return sums


def evaluate(model, store, windows, ctx: DistContext, args, amp_dtype, faults, step) -> tuple[dict | None, list]:
    """Eval on all ranks: per-rank sums, agreement over the control plane, then one all-reduce.

    Returns (metrics, []) or (None, failed ranks) when any rank failed: then every rank skips it.
    """
    sums = None
    try:
        faults.in_eval(step)
        sums = evaluate_shard(model, store, windows, ctx.device, args, amp_dtype)
    except Exception as e:  # noqa: BLE001 - reported, agreed on, and training goes on
        log.error("eval at step %d failed on rank %d: %r", step, ctx.rank, e)
    failed = [r for r, flag in enumerate(exchange(ctx, [sums is None])[:, 0]) if flag > 0]
    if failed:
        return None, failed
    sums.load_vector(all_reduce_sum(ctx, sums.vector()))
    return sums.result(model.config.downsample), []


def codec_config(args, feature_dim: int) -> CodecConfig:
    return CodecConfig(
        feature_dim=feature_dim,
        latent_dim=args.latent_dim,
        codebook_dim=args.codebook_dim,
        num_quantizers=args.num_quantizers,
        codebook_size=args.codebook_size,
        downsample=args.downsample,
        encoder_blocks=args.encoder_blocks,
        kmeans_init=args.kmeans_init,
        ema_decay=args.ema_decay,
        dead_code_threshold=args.dead_code_threshold,
        quantize_dropout=args.quantize_dropout,
        commitment_weight=args.commitment_weight,
        recon_space=args.recon_space,
    )


def gather_rng_states(ctx: DistContext) -> list:
    """Every rank's RNG states, so that a resumed run draws what an unbroken one would have."""
    mine = {"torch": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(ctx.device)
    if not ctx.is_distributed:
        return [mine]
    states = [None] * ctx.world_size
    dist.all_gather_object(states, mine, group=ctx.control)
    return states


def restore_rng_states(states: list, ctx: DistContext) -> None:
    if len(states) != ctx.world_size:
        log.warning("checkpoint has RNG states for %d ranks, this run has %d: reseeding", len(states), ctx.world_size)
        return
    torch.set_rng_state(states[ctx.rank]["torch"])
    if ctx.device.type == "cuda" and "cuda" in states[ctx.rank]:
        torch.cuda.set_rng_state(states[ctx.rank]["cuda"], ctx.device)


def find_resume(args, out_dir: Path):
    if args.resume == "none":
        return None
    if args.resume == "auto":
        return ckpt.load_latest(out_dir / "checkpoints")
    return Path(args.resume), ckpt.load_checkpoint(Path(args.resume))


@dataclass
class TrainingData:
    train_store: FeatureStore  # every training utterance (each rank reads its shard through the plan)
    plan: BatchPlan
    valid_shard: FeatureStore  # this rank's held-out utterances
    windows: tuple  # (utterance, start, length) of this rank's eval windows


def open_data(args, launch) -> TrainingData:
    """Find, validate and shard the features; every problem is a BadInputError (exit 2)."""
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = ensure_demo_corpus()
        log.info("no --data_dir given: training on the built-in DEMO corpus (synthetic speech-like 160-d "
                 "features) in %s", data_dir)
    train_store, valid_store, holdout_note = open_stores(data_dir, args.train_split, args.valid_split, seed=args.seed)
    if holdout_note:
        log.info("%s", holdout_note)
    check_finite(train_store, show_progress=launch.rank == 0)
    check_finite(valid_store, show_progress=launch.rank == 0)
    plan = BatchPlan(train_store.lengths, segment_lengths=train_lengths(args),
                     frames_per_step=args.batch_size * args.segment_length, seed=args.seed, rank=launch.rank,
                     world_size=launch.world_size, multiple_of=args.downsample)
    log.info("train: %s, %d utterances, %d frames, dim %d; held out: %d utterances",
             train_store.description, len(train_store), train_store.total_frames, train_store.dim, len(valid_store))
    if plan.too_short:
        log.warning("%d training utterances are shorter than %d frames and are never sampled",
                    plan.too_short, min(train_lengths(args)))
    if plan.dropped_lengths:
        log.warning("segment length(s) %s dropped: not every rank has an utterance that long; training on %s",
                    plan.dropped_lengths, plan.segment_lengths)
    eval_length = min(plan.segment_lengths)
    valid_shard = valid_store.subset(shard_indices(len(valid_store), launch.rank, launch.world_size), "held out")
    utterances, starts, skipped = eval_windows(valid_shard.lengths, eval_length)
    if skipped:
        log.warning("%d held-out utterances on this rank are shorter than %d frames and are not evaluated",
                    skipped, eval_length)
    return TrainingData(train_store, plan, valid_shard, (utterances, starts, eval_length))


def train(args, stop: StopRequest) -> int:
    launch = detect_launch(args.local_rank)
    setup_logging(launch.rank)
    main_rank = launch.rank == 0
    out_dir = Path(args.output_dir)
    faults = FaultInjector(launch.rank)

    # ---- data: opened and validated before anything is written
    if args.tensorboard:
        require_tensorboard()  # on every rank: a missing package is bad input, exit 2
    data = open_data(args, launch)
    train_store, plan = data.train_store, data.plan
    steps_per_epoch = max(1, plan.steps_per_epoch // args.grad_accum)
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    config = codec_config(args, train_store.dim)
    resume = find_resume(args, out_dir)
    if resume is not None and resume[1]["codec"] != config.to_dict():
        raise BadInputError(f"checkpoint {resume[0]} was trained with codec {resume[1]['codec']}, "
                            f"which differs from this run's flags {config.to_dict()}; use another --output_dir "
                            "or --resume none")

    # ---- device and process groups
    device = select_device(args.device, launch.local_rank, bind_local_rank=launch.world_size > 1)
    ctx = init_distributed(launch, device, timeout_s=args.nccl_timeout, control_timeout_s=args.sync_timeout,
                           output_dir=out_dir)
    live = {"step": 0}  # read by the watchdog thread for its messages
    watchdog = (PeerWatchdog(ctx.rank, ctx.world_size, timeout_s=args.sync_timeout, progress=lambda: live["step"])
                .start() if ctx.is_distributed else None)
    slow_phase = args.slow_phase_timeout or 2 * args.nccl_timeout
    batches, failed = None, False
    metrics = MetricsLog(None)
    try:
        # ---- model (after the process group: the quantizer syncs its codebooks when it exists)
        torch.manual_seed(args.seed)
        model = RVQCodec(config).to(device)
        if resume is None:  # a resumed model brings its statistics in its state dict
            model.set_feature_stats(*(t.to(device) for t in feature_stats(train_store)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99),
                                      weight_decay=args.weight_decay)
        amp_dtype = compute_dtype(args.precision, device)
        scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        torch.manual_seed(args.seed + launch.rank)
        step, samples_seen, bad_steps, bad_in_a_row = 0, 0, 0, 0
        if resume is not None:
            path, state = resume
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
            step, samples_seen = state["step"], state["samples_seen"]
            restore_rng_states(state["rng"], ctx)
            log.info("resumed from %s at step %d", path, step)
        ddp_model = wrap_ddp(model, ctx)

        # ---- outputs: rank 0 alone writes
        if main_rank:
            (out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            save_config(args, out_dir / "config.json")
            metrics = MetricsLog(out_dir / "metrics.jsonl",
                                 tensorboard_dir=out_dir / "tensorboard" if args.tensorboard else None)
        log.info("codec: %d levels x %d codes, latent %d, downsample %d (%.0f bits/frame), %.2fM parameters",
                 config.num_quantizers, config.codebook_size, config.latent_dim, config.downsample,
                 config.num_quantizers * math.log2(config.codebook_size) / config.downsample,
                 sum(p.numel() for p in model.parameters()) / 1e6)
        log.info("training %d steps (%d per epoch), %d frames per rank per step in %d micro-batch(es), lengths %s, "
                 "on %s x %d", total_steps, steps_per_epoch, args.batch_size * args.segment_length * args.grad_accum,
                 args.grad_accum, plan.segment_lengths, device, ctx.world_size)

        my_shard = train_store.subset(shard_indices(len(train_store), ctx.rank, ctx.world_size), "this rank's shard")
        batches = make_batches(args, my_shard, plan, device, step * args.grad_accum, main_rank)
        if step == 0 and config.kmeans_init and args.kmeans_init_frames:
            # k-means on more frames than one batch holds (2048 frames are thin for 1024 codes);
            # the library syncs it across ranks, so every rank runs it, under the slow-phase timeout
            sample = kmeans_sample(my_shard, args.kmeans_init_frames, min(plan.segment_lengths), args.seed + ctx.rank)
            with phase_timeout(ctx, slow_phase, args.nccl_timeout):
                model.init_codebooks(sample.to(device), batch_frames=args.batch_size * args.segment_length)
            log.info("codebooks: k-means init on %d frames per rank", sample.shape[0] * sample.shape[1])

        def save(at_step: int) -> None:
            rng = gather_rng_states(ctx)
            if main_rank:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "step": at_step, "samples_seen": samples_seen,
                         "epoch": at_step // steps_per_epoch, "codec": config.to_dict(),
                         "config": {k: v for k, v in vars(args).items() if k != "local_rank"}, "rng": rng}
                path = ckpt.save_checkpoint(out_dir / "checkpoints", at_step, state, keep=args.keep_checkpoints)
                metrics.write("checkpoint", at_step, path=str(path))
                log.info("checkpoint: %s", path)

        # ---- the loop
        stop_reason = None if step < total_steps else "max_steps"
        bar = tqdm(total=total_steps, initial=step, disable=not main_rank, desc="train", unit="step",
                   dynamic_ncols=True, mininterval=1.0)
        throughput = start_step_timer(model, device, amp_dtype, ctx.world_size, log)  # frames/s, data wait, MFU
        loop_start = time.perf_counter()  # --max_minutes counts from here
        while stop_reason is None:
            faults.before_step(step, model)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args, total_steps)
            optimizer.zero_grad(set_to_none=True)
            # the first step runs k-means init across ranks: it gets the slow-phase timeout
            with phase_timeout(ctx, slow_phase, args.nccl_timeout) if step == 0 else contextlib.nullcontext():
                for micro in range(args.grad_accum):
                    with throughput.waiting_for_data():
                        batch, x = batches.get(step * args.grad_accum + micro)
                    last = micro == args.grad_accum - 1
                    # gradients are all-reduced once per step, on the last micro-batch
                    with ddp_model.no_sync() if ctx.is_distributed and not last else contextlib.nullcontext():
                        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                            out = ddp_model(x)
                        scaler.scale(faults.loss(step, out.loss) / args.grad_accum).backward()
                    samples_seen += len(batch.utterances)
                    throughput.add_frames(batch.frames * ctx.world_size)
            scaler.unscale_(optimizer)
            # The gradients are all-reduced, so this norm is the same on every rank: a NaN on any
            # rank skips the step on all of them, with no extra collective.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)
            if torch.isfinite(grad_norm):
                scaler.step(optimizer)
                bad_in_a_row = 0
            else:
                bad_steps += 1
                bad_in_a_row += 1
                metrics.write("skipped_step", step + 1, reason="non-finite loss or gradient", bad_steps=bad_steps)
                log.warning("step %d: non-finite loss or gradient, update skipped on every rank (%d so far)",
                            step + 1, bad_steps)
            scaler.update()
            step += 1
            live["step"] = step
            bar.update(1)
            if bad_in_a_row > args.max_bad_steps:
                save(step)
                metrics.write("stop", step, reason=f"{bad_in_a_row} non-finite steps in a row")
                log.error("%d non-finite steps in a row (more than --max_bad_steps %d): checkpoint written, "
                          "stopping; lower --lr or check the data", bad_in_a_row, args.max_bad_steps)
                return EXIT_FAILURE

            if step % args.log_every == 0:
                speed = throughput.report()  # frames_per_sec, data_wait_frac, mfu
                loss = out.loss.item()
                metrics.write("train", step, loss=loss, recon=out.recon_loss.item(), commit=out.commit_loss.item(),
                              lr=optimizer.param_groups[0]["lr"], **speed,
                              segment_length=batch.segment_length, bad_steps=bad_steps)
                bar.set_postfix(loss=f"{loss:.4f}", fps=f"{speed['frames_per_sec']:,.0f}",
                                wait=f"{speed['data_wait_frac']:.1%}", mfu=f"{speed['mfu']:.1%}")

            if step >= total_steps:
                stop_reason = "max_steps" if args.max_steps else "epochs"
            out_of_time = args.max_minutes is not None and time.perf_counter() - loop_start >= 60 * args.max_minutes
            if ctx.is_distributed and (step % args.sync_check_every == 0 or stop_reason):
                result = sync_check(ctx, step=step, epoch=step // steps_per_epoch, samples_seen=samples_seen,
                                    stop=bool(stop), codebooks=codebook_tensors(model))
                if result.stop and stop_reason is None:
                    stop_reason = f"signal on rank(s) {result.stop_ranks}"
                if args.max_minutes is not None:  # rank 0's clock decides, so every rank stops at this step
                    rank0_out_of_time = exchange(ctx, [out_of_time])[0, 0] > 0
                    if rank0_out_of_time and stop_reason is None:
                        stop_reason = "max_minutes"
            elif not ctx.is_distributed and stop and stop_reason is None:
                stop_reason = f"signal {stop.reason}"
            elif not ctx.is_distributed and out_of_time and stop_reason is None:
                stop_reason = "max_minutes"

            # a stop on request skips the refit and the final eval: a preempted job may have seconds left
            schedule_done = stop_reason in ("max_steps", "epochs", "max_minutes")
            if schedule_done and args.refit_iters:
                with phase_timeout(ctx, slow_phase, args.nccl_timeout):
                    refit(model, my_shard, ctx, args, metrics, step, device)
            if step % args.eval_every == 0 or schedule_done:
                with phase_timeout(ctx, slow_phase, args.nccl_timeout):
                    result, failed = evaluate(model, data.valid_shard, data.windows, ctx, args,
                                              amp_dtype, faults, step)
                if failed:
                    metrics.write("eval_failed", step, ranks=failed)
                    log.warning("eval at step %d skipped on every rank: it failed on rank(s) %s", step, failed)
                else:
                    result["dead_codes"] = dead_code_counts(model)
                    metrics.write("eval", step, **result)
                    log.info("eval at step %d: rel_mse %.4f, cosine %.4f, code usage %s, dead codes %s, "
                             "%.0f bits/frame", step, result["rel_mse"], result["cosine"], result["code_usage"],
                             result["dead_codes"], result["bits_per_frame"])
                    low = [level for level, u in enumerate(result["code_usage"]) if u < LOW_USAGE]
                    if low:
                        log.warning("eval at step %d: level(s) %s use less than %.0f%% of their codes on held-out "
                                    "data (usage %s): codebook collapse", step, low, 100 * LOW_USAGE,
                                    [result["code_usage"][level] for level in low])
            if step % args.save_every == 0 or stop_reason:
                save(step)
        bar.close()
        metrics.write("stop", step, reason=stop_reason)
        final_barrier(ctx, args.sync_timeout)
        log.info("finished at step %d: %s", step, stop_reason)
        return EXIT_OK
    except Exception as e:
        failed = True
        if not is_distributed_error(e):
            raise
        # a collective failed: a peer is probably gone; the watchdog names it and exits
        log.error("rank %d at step %d: a collective failed: %s", ctx.rank, live["step"], e)
        if watchdog is not None:
            watchdog.await_verdict(args.sync_timeout + 10)
        raise DistributedFailure(f"rank {ctx.rank} stopped at step {live['step']}: {e}") from e
    finally:
        if batches is not None:
            batches.close()
        if watchdog is not None:
            watchdog.stop()
        metrics.close()
        if not failed:  # tearing down groups with a lost peer can block; the process exit frees them
            destroy()


def main(argv=None) -> int:
    args = parse_args(argv)
    stop = StopRequest().install()
    try:
        return train(args, stop)
    except BadInputError as e:
        log.error("%s", e)
        return e.exit_code
    except DistributedFailure as e:
        log.error("distributed failure: %s", e)
        return e.exit_code
    except Exception:
        log.exception("training failed")
        return EXIT_FAILURE
    finally:
        stop.restore()


if __name__ == "__main__":
    sys.exit(main())
