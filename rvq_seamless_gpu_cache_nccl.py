#!/usr/bin/env python3
"""Train a multi-length residual vector quantizer (RVQ) on SeamlessM4T features.

One process (`python rvq_seamless_gpu_cache_nccl.py ...`) or many (`torchrun`,
`python -m torch.distributed.launch`, `accelerate launch`, `srun`). `train()` is
the table of contents: set up, then a loop of named steps (train_step,
decide_stop, end_of_schedule, evaluate, maybe_save), then tear down; each step
is a method of `Trainer` below. The machinery lives in data/, models/ and training/.

Exit codes: 0 done or stopped on request (checkpoint written); 2 bad flags or
data (nothing written); 3 a distributed failure (the rank is named); 1 anything
else, including too many non-finite steps in a row (checkpoint written).
"""
from __future__ import annotations

import time

STARTED = time.monotonic()  # --max_minutes count from here: imports, data checks and set-up included

if __name__ == "__main__":  # a stop signal during the imports below (seconds) is recorded, not fatal: main() stops
    from training.stop_signals import record_stops  # the run before its first step (the standard library only)

    record_stops()

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.bad_crops import BadCrops
from data.training_data import TrainingData, batch_source, open_training_data
from errors import EXIT_FAILURE, EXIT_OK, BadInputError, DistributedFailure, RanksDiverged, TransientFault
from models.codebook_ops import codebook_tensors
from models.codec import CodecConfig, RVQCodec
from models.compiled_step import check_compile, compile_mode, graphs_and_breaks
from training.checkpoint import Checkpointer, Resume
from training.codebooks import feature_stats, init_codebooks, refit
from training.config import OptimConfig, TrainConfig, parse_args, resumed_optim, save_config
from training.optimizer import build_optimizer
from training.device import cache_dtype, compute_dtype, make_deterministic, select_device
from training.distributed import (DistContext, all_reduce_sum, destroy, detect_launch, dump_flight_recorder,
                                  final_barrier, free_destroyed_groups, init_distributed,
                                  make_flight_recorder_dir, phase_timeout, wrap_ddp)
from training.evaluate import agree_on_phones, evaluate
from training.faults import FaultInjector
from training.log_stream import end_process, exit_now, log_to_stderr, report_crashes, write_line
from training.metrics_log import MetricsLog, require_tensorboard
from training.output_dir import OutputDirLock
from training.progress import END_OF_SCHEDULE, FAILED, STOPPED, Progress
from training.resume import agree_on_resume
from training.run_folder import RunFolder
from training.schedule import REFIT_SHARE, Schedule, ScheduleEnd
from training.signals import Interrupted, Stopped, StopRequest, agree_to_stop, stop_reason
from training.step_guard import StepOutcome, guarded_step
from training.sync_check import CheckSchedule, sync_check
from training.threads import set_cpu_threads
from training.throughput import start_step_timer
from training.watchdog import PeerWatchdog

log = logging.getLogger("rvq")


def train(cfg: TrainConfig, stop: StopRequest) -> int:
    """The whole job: set up, the loop of named steps, tear down."""
    launch = detect_launch(cfg.local_rank)
    setup_logging(launch.rank)
    faults = FaultInjector(launch.rank)
    # ---- everything a user can get wrong is found before anything is written (exit 2)
    if cfg.run.tensorboard:
        require_tensorboard()  # on every rank: a missing package is bad input
    if cfg.optim.deterministic:
        make_deterministic()  # before any CUDA work
    device = select_device(cfg.run.device, launch.local_rank, bind_local_rank=launch.world_size > 1)
    check_compile(cfg.optim.compile, device)
    data = open_training_data(cfg.data, rank=launch.rank, world_size=launch.world_size, seed=cfg.optim.seed,
                              multiple_of=cfg.codec["downsample"], device_type=device.type,
                              manifest_dir=Path(cfg.run.output_dir), save_manifests=False)
    given = cfg  # config.json's and the checkpoints' flags: as given (the automatic choices are logged; a resumed
    # run's kept settings are its checkpoint's, below)
    cfg = dataclasses.replace(cfg, data=data.config)  # the batch size and automatic segment length decided
    codec = cfg.codec_config(data.train.dim)
    # ---- one run per output dir: rank 0 locks it for the run's life (a refusal is raised once every rank knows it)
    output = OutputDirLock(cfg.run.output_dir, launch.rank).take()
    # ---- process groups
    ctx = init_distributed(launch, device, timeout_s=cfg.dist.nccl_timeout, control_timeout_s=cfg.dist.sync_timeout,
                           output_dir=Path(cfg.run.output_dir))
    # ---- the output dir is ours, the held-out phone labels (if any) are usable and alike on every rank, then rank 0
    # chooses the checkpoint and every rank loads it (exit 2 on every rank if any fails; exit 1 on an OS error
    # while reading), then the model
    try:
        output.agree(ctx)
        agree_on_phones(ctx, data.eval.phones)
        with phase_timeout(ctx, cfg.dist.slow_phase_s):  # each side waits while the other reads a checkpoint
            resume = agree_on_resume(ctx, cfg.run.resume, RunFolder(cfg.run.output_dir).checkpoints, codec,
                                     data=data.identity, finetune=cfg.run.finetune)
        # once the resume is known (a resumed run computes as its run did), and before the run's first torch work:
        # the feature statistics below are computed with the run's own thread count, as every later step is
        set_threads(cfg.run.threads, device, resume)
        if resume is not None:  # it trains on its own schedule and optimizer: a new default never changes them
            optim = keep_schedule(cfg, resume)
            cfg, given = dataclasses.replace(cfg, optim=optim), dataclasses.replace(given, optim=optim)
        # the features' mean and scale, when the codec takes them from this data: the same sample on every rank
        stats = feature_stats(data.train) if resume is None or resume.new_data else None
    except (BadInputError, TransientFault):  # every rank raises it together: the groups go down here, not in the
        output.abandon()  # interpreter's exit
        destroy()
        raise
    data.save_manifests()  # the output dir is this run's from here on
    make_flight_recorder_dir(ctx, Path(cfg.run.output_dir))
    trainer = Trainer(cfg, ctx, data, codec, stop, faults, output, given)
    try:
        trainer.build(resume, stats)
        # ---- the loop
        while trainer.progress.stop_reason is None:
            trainer.train_step()
            trainer.log_step()
            trainer.decide_stop()
            if trainer.progress.stop_reason is None and trainer.progress.step % cfg.run.eval_every == 0:
                trainer.evaluate()  # a stop agreed during it ends the loop
            trainer.maybe_save()
        if isinstance(trainer.progress.stop_reason, ScheduleEnd):
            trainer.end_of_schedule()  # the codebook refit and the final eval, or what a resumed run has left
        trainer.save_last()
        return trainer.finish()
    except RanksDiverged:  # every rank raises it from the same exchange: the groups go down in close(), as after
        raise  # a clean run, and main() frees them (free_destroyed_groups)
    except Exception as e:
        trainer.failed = True
        judged = ctx.is_distributed and not isinstance(e, (BadInputError, TransientFault))  # those are every rank's
        lost = trainer.lost_peer(e) if judged else None
        if lost is None:  # this rank's own error: exit 1 with its traceback (2 for bad input)
            raise
        raise lost from e
    finally:
        trainer.close()


class Trainer:
    """The run's objects and the named steps of its loop; `progress` is the loop's state."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, data: TrainingData, codec: CodecConfig,
                 stop: StopRequest, faults: FaultInjector, output: OutputDirLock, given: TrainConfig):
        """given: the configuration as the flags gave it (a resumed run's kept settings its checkpoint's), before the
        automatic choices that `cfg` holds."""
        self.cfg, self.ctx, self.data, self.codec, self.stop, self.faults = cfg, ctx, data, codec, stop, faults
        self.output, self.given = output, given
        self.main_rank = ctx.rank == 0
        self.folder = RunFolder(cfg.run.output_dir)
        self.progress = Progress()
        self.steps_per_epoch = max(1, data.plan.steps_per_epoch // cfg.optim.grad_accum)
        # the checkpoint says what features the codec learns (tools.extract's notes): tools.tokenize makes them again
        features = data.identity["features"]
        self.checkpointer = Checkpointer(self.folder.checkpoints, keep=cfg.run.keep_checkpoints, ctx=ctx,
                                         codec=codec, config={**given.to_dict(), "features": features},
                                         steps_per_epoch=self.steps_per_epoch, data=data.identity)
        self.amp_dtype = compute_dtype(cfg.optim.precision, ctx.device)
        self.metrics = MetricsLog(None)  # rank 0's writes to the output dir, once build() opens it
        self.batches = None
        self.bar = None  # the training bar, once the loop is to run (build)
        self.codebooks_before = None  # the quantizer's buffers before the step (Trainer.train_step)
        self.failed = False  # the run raised: the process groups are left to the process exit (a peer may be gone)
        self.exit_code = EXIT_OK
        self.saved = None  # (step, end-of-schedule work done) of the last checkpoint written or resumed from
        self.write_failed = False  # a checkpoint write failed: the run stops, the one before stays the newest
        self.progress.on_enter.append(faults.on_phase)
        self.progress.slow_timeout = self.slow_phase  # a slow phase's longer process-group timeout (PHASES)
        self.watchdog = (PeerWatchdog(ctx.rank, ctx.world_size, timeout_s=cfg.dist.sync_timeout,
                                      slow_timeout_s=cfg.dist.slow_phase_s, progress=self.progress,
                                      on_verdict=lambda: dump_flight_recorder(ctx, self.folder.root),
                                      on_peer_stopped=self.record_stop, stop=stop).start()
                         if ctx.is_distributed else None)

    def slow_phase(self):
        """The process group's timeout for a legitimately slow phase: k-means init, eval, refit, checkpoint."""
        return phase_timeout(self.ctx, self.cfg.dist.slow_phase_s)

    # ---- set up

    def build(self, resume: Resume | None, stats: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Model, optimizer, resume, outputs, batch source, k-means init; then the loop's clock starts. `stats`: the
        features' mean and std, for a new run or --finetune (a resumed model brings its own in its state dict)."""
        cfg, ctx, p = self.cfg, self.ctx, self.progress
        torch.manual_seed(cfg.optim.seed)
        self.model = RVQCodec(self.codec).to(ctx.device)  # after the process group: the quantizer syncs on it
        if stats is not None:
            self.model.set_feature_stats(*(t.to(ctx.device) for t in stats))
        self.params = list(self.model.parameters())  # listed once: walking the modules every step is host time
        self.optimizer = build_optimizer(cfg.optim.optimizer, self.params, lr=cfg.optim.lr,
                                         weight_decay=cfg.optim.weight_decay, device=ctx.device)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.amp_dtype == torch.float16)
        torch.manual_seed(cfg.optim.seed + ctx.rank)
        if resume is not None:
            self.checkpointer.restore(resume, self.model, self.optimizer, self.scaler, p)
            for group in self.optimizer.param_groups:  # the state dict brings the checkpoint's; the flag decides
                group["weight_decay"] = cfg.optim.weight_decay
            if stats is not None:  # --finetune: the codec standardises the features it now trains on by their own
                self.model.set_feature_stats(*(t.to(ctx.device) for t in stats))
            self.saved = (p.step, tuple(p.end_of_schedule))
        self.schedule = Schedule(cfg.optim, steps_per_epoch=self.steps_per_epoch, world_size=ctx.world_size,
                                 frames_per_step=cfg.data.frames_per_step * cfg.optim.grad_accum,
                                 codebook_size=self.codec.codebook_size, started_at=STARTED, start_step=p.step,
                                 start_fraction=p.schedule_fraction, time_spent=p.time_spent,
                                 per_frame=p.seconds_per_frame)
        ended = self.schedule.stop_reason(p.step)  # a resumed run at the end of its schedule
        if ended is None:  # training goes on: the end-of-schedule work is to come
            p.end_of_schedule = []
        self.ddp_model = wrap_ddp(self.model, ctx)
        finished = resume is not None and ended is not None and set(END_OF_SCHEDULE) <= set(p.end_of_schedule)
        self.open_outputs(training=not finished)
        if finished:  # nothing to train, refit or evaluate: no batches, compile, bar or timing, on every rank alike
            p.stop_reason = ended
            log.warning("%s holds a finished run (step %d, %s; its refit and final eval done): nothing is left to "
                        "do. To train afresh, give another --output_dir; to train on from it, a larger budget "
                        "(--max_steps, --max_minutes)", self.folder.root, p.step, self.schedule.describe())
            return
        if self.stop_before_the_first_step():
            return
        self.batches = batch_source(cfg.data, self.data.shard, self.data.plan, ctx.device,
                                    start_step=p.step * cfg.optim.grad_accum, show_progress=self.main_rank,
                                    cache_dtype=cache_dtype(ctx.device, self.data.shard.dtype == np.float16,
                                                            cfg.optim.precision))
        self.bad_crops = BadCrops(self.data.shard, self.data.plan)
        if p.step == 0 and self.codec.kmeans_init and cfg.codebooks.kmeans_init_frames:
            self.init_codebooks()
            if p.stop_reason is not None:  # stopped before the first step: nothing more is timed, compiled or shown
                return
        mode, why = compile_mode(cfg.optim.compile, ctx.device, steps=self.schedule.steps,
                                 minutes=cfg.optim.max_minutes)
        if mode is None:
            log.info("compile: the training step runs eager (%s)", why)
        else:
            self.model.compile_training(mode, variants=len(self.data.plan.segment_lengths))
            log.info("compile: the training step runs under torch.compile (mode %s; %s), compiled at the first step "
                     "of each segment length %s", mode, why, self.data.plan.segment_lengths)
        self.bar = tqdm(total=self.schedule.steps, initial=p.step, disable=not self.main_rank, desc="train",
                        unit="step", dynamic_ncols=True, mininterval=1.0)
        self.timer = start_step_timer(self.model, ctx.device, self.amp_dtype, ctx.world_size, log)
        self.schedule.check_setup()  # a --max_minutes budget that the set-up has mostly spent is said at once
        self.checks = CheckSchedule(cfg.dist.sync_check_every, p.step)
        p.phase = "train"
        if p.stop_reason is None:  # a run resumed at the end of its schedule goes to what is left of its end
            p.stop_reason = self.schedule.stop_reason(p.step)

    def stop_before_the_first_step(self) -> bool:
        """A stop requested during the set-up (a signal during the imports included: StopRequest.install), agreed
        by every rank before the device cache is filled: the run ends with nothing trained since its start, so
        nothing to save (finish() says so in the stop event), and exits 0."""
        p = self.progress
        reason = agree_to_stop(self.ctx, self.stop)
        if reason is None:
            return False
        p.stop_reason = f"{reason} before the first step"
        log.warning("stopped before the first step (%s): nothing trained%s, no checkpoint written; relaunch the same "
                    "command to %s", reason, f" since step {p.step}" if p.step else "",
                    f"resume from step {p.step}" if p.step else "start the run")
        return True

    def init_codebooks(self) -> None:
        """k-means before the first step. A stop during it ends the run with nothing trained, so nothing to save:
        a signal abandons it at once, wherever the main thread is (the library's passes over the sample are not
        waited for); on several ranks this rank then leaves and its peers stop too (Trainer.leave)."""
        cfg, ctx, p = self.cfg, self.ctx, self.progress
        interrupted = False
        try:
            with self.stop.abandoning("the k-means init"), p.phase_of("k-means init"):
                init_codebooks(self.model, self.data.shard, frames=cfg.codebooks.kmeans_init_frames,
                               length=min(self.data.plan.segment_lengths), seed=cfg.optim.seed + ctx.rank,
                               batch_frames=cfg.data.frames_per_step, ctx=ctx, stop=self.stop)
            return
        except Stopped as stopped:  # agreed by every rank between two iterations
            p.stop_reason = f"{stopped} during the k-means init"
        except Interrupted as interruption:
            interrupted = True
            p.stop_reason = (f"signal {interruption}" + (f" on rank {ctx.rank}" if ctx.is_distributed else "")
                             + " during the k-means init")
        log.warning("stopped during the k-means init, before the first step: nothing trained, no checkpoint "
                    "written (a relaunch starts afresh)")
        if interrupted and ctx.is_distributed:  # the peers may be inside the library's collectives
            self.leave()

    def forward_backward(self, x: torch.Tensor, keep: torch.Tensor, step: int, micro_batches: int = 1):
        """One micro-batch's forward and backward (the gradient all-reduce, under DDP); returns the forward's output.
        The first of each compiled variant (segment length, dropout depth) compiles: a slow phase, timed and logged;
        compile time counts in --max_minutes like the rest. A compile comes after a checkpoint (save_before_compile),
        so that a stop during it, on any number of ranks, has nothing to save and may abandon it at once."""
        p = self.progress
        seed = self.dropout_seed(step)
        compiling = self.model.compiles(x, seed)
        start = time.monotonic()
        if compiling:
            before = graphs_and_breaks()
            log.info("compile: compiling the training step for segment length %d (forward and backward)", x.shape[1])
        # a signal before it raises at once: nothing is compiled
        with self.stop.abandoning("the compile") if compiling else contextlib.nullcontext():
            with p.phase_of("compile" if compiling else "forward"), torch.autocast(
                    self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                out = self.ddp_model(x, keep, dropout_seed=seed)
            with p.phase_of("compile" if compiling else "backward"):  # the gradient all-reduce
                self.scaler.scale(self.faults.loss(p.step, out.loss) / micro_batches).backward()
        if compiling:
            graphs, breaks = (after - earlier for after, earlier in zip(graphs_and_breaks(), before))
            log.info("compile: the training step for segment length %d compiled (forward and backward) in %.1f s: "
                     "%d graph(s), %d graph break(s)", x.shape[1], time.monotonic() - start, graphs, breaks)
        return out

    def dropout_seed(self, step: int) -> int:
        """Quantize dropout's depth at this micro-step: alike on every rank, no collective."""
        return self.cfg.optim.seed * 1_000_003 + step

    def save_before_compile(self, samples_seen: int) -> None:
        """The trained state, saved before a compile (every rank reaches it at the same micro-step: the compiled
        variants follow the step): the state of the last step taken, with the codebooks and samples of the
        micro-batches of this step put back while it is written."""
        p = self.progress
        log.info("compile: saving step %d first, so that a stop during the compile has nothing to save", p.step)
        current, running = self.model.codebook_state(), p.samples_seen
        self.model.restore_codebook_state(self.codebooks_before)
        p.samples_seen = samples_seen
        try:
            self.save()
        finally:
            self.model.restore_codebook_state(current)
            p.samples_seen = running

    def open_outputs(self, training: bool = True) -> None:
        """Rank 0 alone writes: config.json, metrics.jsonl (and TensorBoard), checkpoints/. `training`: the loop
        is to run (its budget and batches said in the log)."""
        cfg, codec = self.cfg, self.codec
        if self.main_rank:
            self.folder.checkpoints.mkdir(parents=True, exist_ok=True)
            save_config(self.given, self.folder.config)
            self.metrics = MetricsLog(self.folder.metrics,
                                      tensorboard_dir=self.folder.tensorboard if cfg.run.tensorboard else None)
        log.info("codec: %d levels x %d codes, latent %d, downsample %d (%.0f bits/frame), %.2fM parameters",
                 codec.num_quantizers, codec.codebook_size, codec.latent_dim, codec.downsample,
                 codec.num_quantizers * math.log2(codec.codebook_size) / codec.downsample,
                 sum(p.numel() for p in self.model.parameters()) / 1e6)
        if not training:
            return
        log.info("training for %s; %d steps per epoch, %d frames per rank per step in %d micro-batch(es), "
                 "lengths %s, on %s x %d", self.schedule.describe(), self.steps_per_epoch,
                 cfg.data.frames_per_step * cfg.optim.grad_accum, cfg.optim.grad_accum,
                 self.data.plan.segment_lengths, self.ctx.device, self.ctx.world_size)

    # ---- the loop's steps

    def train_step(self) -> None:
        """One optimizer step over --grad_accum micro-batches, skipped on every rank if the gradient is not finite."""
        cfg, ctx, p = self.cfg, self.ctx, self.progress
        accum = cfg.optim.grad_accum
        self.faults.before_step(p.step, self.model)
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.learning_rate(p.step)
        self.optimizer.zero_grad(set_to_none=True)
        # the forward updates them; a skipped step puts them back (copied into the same tensors every step)
        self.codebooks_before = self.model.codebook_state(into=self.codebooks_before)
        seen = p.samples_seen
        try:  # every phase of the first step, which may run the k-means init across ranks, is slow (PHASES)
            for micro in range(accum):
                with self.timer.waiting_for_data(), p.phase_of("data"):
                    batch, x = self.batches.get(p.step * accum + micro)
                keep = self.bad_crops.check(batch, x)  # crops with a NaN or Inf frame are dropped on the device
                compiles = self.model.compiles(x, self.dropout_seed(p.step * accum + micro))
                if compiles and not self.nothing_to_save():
                    self.save_before_compile(seen)
                    if self.write_failed:  # on every rank alike (rank 0 sent the outcome): the run ends here
                        self.untake_step(seen)
                        return
                # gradients are all-reduced once per step, on the last micro-batch
                with (self.ddp_model.no_sync() if ctx.is_distributed and micro < accum - 1
                      else contextlib.nullcontext()):
                    out = self.forward_backward(x, keep, p.step * accum + micro, micro_batches=accum)
                p.samples_seen += len(batch.utterances)
                self.timer.add_frames(batch.frames * ctx.world_size)
        except Interrupted as interrupted:
            self.untake_step(seen)
            self.abandon_step(f"signal {interrupted}" + (f" on rank {ctx.rank}" if ctx.is_distributed else ""))
            return
        with p.phase_of("data"):  # the next step's batch, started before this step's one host sync (the guard's)
            self.batches.prepare((p.step + 1) * accum)
        p.enter("optimizer")
        self.scaler.unscale_(self.optimizer)
        # The gradients are all-reduced, so this norm is the same on every rank: a NaN on any
        # rank skips the step on all of them, with no extra collective.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip or math.inf)
        outcome = guarded_step(self.scaler, self.optimizer, grad_norm)
        if outcome is StepOutcome.APPLIED:
            p.bad_in_a_row = 0
            self.model.maybe_expire_dead_codes(p.step + 1, out)  # every --dead_code_every steps
        else:  # skipped: the quantizer's updates in this step's forward are undone too
            self.model.restore_codebook_state(self.codebooks_before)
        if outcome is StepOutcome.BAD:
            p.bad_steps += 1
            p.bad_in_a_row += 1
            self.metrics.write("skipped_step", p.step + 1, reason="non-finite loss or gradient", bad_steps=p.bad_steps)
            log.warning("step %d: non-finite loss or gradient, update skipped on every rank (%d so far)",
                        p.step + 1, p.bad_steps)
        p.step += 1
        p.schedule_fraction = self.schedule.fraction(p.step)
        p.enter("train")
        self.bar.update(1)
        self.last = (out, batch)

    def nothing_to_save(self) -> bool:
        """No step trained since the last checkpoint written or resumed from (or none at all), nor anything done
        after the schedule's end: alike on every rank."""
        p = self.progress
        return self.saved == (p.step, tuple(p.end_of_schedule)) if self.saved is not None else p.step == 0

    def untake_step(self, samples_seen: int) -> None:
        """The step is not taken: its forwards' codebook updates and gradients are dropped; the loop ends."""
        p = self.progress
        self.model.restore_codebook_state(self.codebooks_before)
        self.optimizer.zero_grad(set_to_none=True)
        p.samples_seen, p.phase, self.last = samples_seen, "train", None

    def abandon_step(self, reason: str) -> None:
        """A stop during a compile, the step not taken. The trained state was saved before the compile, so there
        is nothing to save: on several ranks, this rank leaves at once (Trainer.leave)."""
        p = self.progress
        p.stop_reason = f"{reason} during the compile"
        log.warning("stopped during the compile of step %d: nothing trained since the last checkpoint%s, so nothing "
                    "to save; the compile is abandoned", p.step + 1,
                    f" (step {p.step}, written before the compile)" if p.step else "")
        if self.ctx.is_distributed:
            self.leave()

    def leave(self) -> None:
        """On several ranks, a stop with nothing to save: this rank records it, tells its peers through the
        watchdog (they stop too, exit 0, rather than report it lost), and exits 0 at once, without the collectives
        of an agreed stop (a peer may be inside a compile or a compiled step)."""
        self.record_stop(self.progress.stop_reason)
        self.progress.phase = STOPPED
        self.watchdog.leave()
        log.warning("rank %d stopped at step %d: %s; exit code 0", self.ctx.rank, self.progress.step,
                    self.progress.stop_reason)
        exit_now(EXIT_OK)  # the process groups are left to the exit: their teardown would wait for the peers

    def record_stop(self, reason: str) -> None:
        """Rank 0 writes the stop event of a run that ends with nothing to save (also from the watchdog's thread)."""
        self.metrics.write("stop", self.progress.step, reason=reason)
        self.metrics.close()

    def log_step(self) -> None:
        p = self.progress
        if p.step % self.cfg.run.log_every or self.last is None:  # None: a step abandoned (abandon_step)
            return
        out, batch = self.last
        speed = self.timer.report()  # frames_per_sec, data_wait_frac, mfu
        loss = out.loss.item()
        self.metrics.write("train", p.step, loss=loss, recon=out.recon_loss.item(), commit=out.commit_loss.item(),
                           lr=self.optimizer.param_groups[0]["lr"], **speed, segment_length=batch.segment_length,
                           bad_steps=p.bad_steps, **self.count_bad_crops())
        self.bar.set_postfix(loss=f"{loss:.4f}", fps=f"{speed['frames_per_sec']:,.0f}",
                             wait=f"{speed['data_wait_frac']:.1%}", mfu=f"{speed['mfu']:.1%}")

    def count_bad_crops(self) -> dict:
        """Crops dropped and utterances found non-finite so far, over all ranks (one sum, at log time)."""
        self.bad_crops.collect()
        counts = torch.tensor([self.bad_crops.dropped_crops, len(self.bad_crops.bad_utterances)],
                              dtype=torch.int64, device=self.ctx.device)
        dropped, utterances = all_reduce_sum(self.ctx, counts).tolist()
        return {"dropped_crops": dropped, "bad_utterances": utterances}

    def decide_stop(self) -> None:
        """Every reason to stop, the same on every rank: the schedule, too many bad steps (both decided alike
        everywhere), and a signal or --max_minutes, agreed in the sync check's one exchange (within seconds: the
        checks come by time as well as by step, CheckSchedule)."""
        cfg, ctx, p, schedule = self.cfg, self.ctx, self.progress, self.schedule
        if p.bad_in_a_row > cfg.optim.max_bad_steps:
            p.stop_reason, self.exit_code = f"{p.bad_in_a_row} non-finite steps in a row", EXIT_FAILURE
        steps_in_time = schedule.estimate(p.step, **self.end_work())
        out_of_time = schedule.out_of_time()
        if not ctx.is_distributed:
            signal = stop_reason(ctx, self.stop, [])
            time_up = out_of_time
        elif self.checks.due(p.step) or p.stop_reason or schedule.stop_reason(p.step):
            with p.phase_of("sync check"):
                result = sync_check(ctx, step=p.step, epoch=p.step // self.steps_per_epoch,
                                    samples_seen=p.samples_seen, stop=bool(self.stop), out_of_time=out_of_time,
                                    steps_in_time=steps_in_time, codebooks=codebook_tensors(self.model),
                                    checks=self.checks)
            signal = stop_reason(ctx, self.stop, result.stop_ranks)
            time_up, steps_in_time = result.out_of_time, result.steps_in_time  # rank 0's clock decides for every rank
        else:
            time_up, steps_in_time, signal = False, None, None
        schedule.set_steps_in_time(steps_in_time)
        if steps_in_time is not None and self.bar.total != schedule.total:
            self.bar.total = schedule.total
        if p.stop_reason is None:
            p.stop_reason = signal or (ScheduleEnd.MAX_MINUTES if time_up else schedule.stop_reason(p.step))

    def end_work(self) -> dict:
        """What the end of the schedule will do: the refit's frames on this rank, the final eval's over all."""
        refit = self.cfg.codebooks
        windows = self.data.eval
        return {"refit_frames": min(refit.refit_frames, self.data.shard.total_frames) if refit.refit_iters else 0,
                "refit_iters": refit.refit_iters, "beam_size": self.codec.beam_size,
                "eval_frames": len(windows.utterances) * windows.length * self.ctx.world_size}

    def end_of_schedule(self) -> None:
        """The codebooks' last pass over whole utterances, then the final eval, or what a resumed run has left of
        them (Progress.end_of_schedule, kept in the checkpoint). A stop on request before them skips both (a preempted
        job may have seconds left); one during them ends them at their next chunk, and a resume does the rest."""
        p = self.progress
        start, done_before = time.monotonic(), list(p.end_of_schedule)
        if self.bar is not None:  # the training bar ends before the refit's and the final eval's start
            self.bar.close()
        if p.stop_reason == ScheduleEnd.MAX_MINUTES:  # the budget is spent: a relaunch does only what is left here
            self.schedule.ran_out = True
        if "refit" not in p.end_of_schedule:
            self.refit()
        if isinstance(p.stop_reason, ScheduleEnd) and "final eval" not in p.end_of_schedule:
            self.evaluate(final=True)  # the codes encode gives; the evals before follow training's
        if self.schedule.deadline is not None and isinstance(p.stop_reason, ScheduleEnd) \
                and p.end_of_schedule != done_before:  # a finished run relaunched did none of it
            log.info("end of schedule: refit and final eval took %.0f s (%.0f s were kept for them and the "
                     "checkpoint)", time.monotonic() - start, self.schedule.end_work)

    def refit(self) -> None:
        """The codebook refit. A stop during it puts back the codebooks training left: the checkpoint then holds
        the trained weights, and a run resumed from it does the refit."""
        cfg, p = self.cfg, self.progress
        iters = cfg.codebooks.refit_iters
        if iters:
            frames = self.schedule.refit_frames(cfg.codebooks.refit_frames, iters, self.codec.beam_size)
            if frames < min(cfg.codebooks.refit_frames, self.data.shard.total_frames):
                log.info("codebooks: the refit reads %d frames per rank, not --refit_frames %d: what fits in %.0f%% "
                         "of --max_minutes", frames, cfg.codebooks.refit_frames, 100 * REFIT_SHARE)
            trained = self.codebooks_before = self.model.codebook_state(into=self.codebooks_before)
            try:
                with p.phase_of("refit"):
                    refit(self.model, self.data.shard, self.ctx, iters=iters, frames=frames,
                          batch_frames=cfg.data.frames_per_step, seed=cfg.optim.seed, step=p.step,
                          metrics=self.metrics, stop=self.stop)
            except Stopped as stopped:
                self.model.restore_codebook_state(trained)
                p.stop_reason = f"{stopped} during the refit"
                log.warning("stopped during the refit: the codebooks are put back as training left them, and the "
                            "checkpoint holds them; a run resumed from it does the refit and the final eval")
                return
        p.end_of_schedule.append("refit")

    def evaluate(self, final: bool = False) -> None:
        """An eval on every rank; the final one's codes come from the codec's beam search. A stop during it ends
        the run (the eval is left unfinished)."""
        p = self.progress
        try:
            with p.phase_of("eval"):
                result = evaluate(self.model, self.data.eval, self.ctx, amp_dtype=self.amp_dtype,
                                  batch_frames=self.cfg.data.frames_per_step, step=p.step, metrics=self.metrics,
                                  faults=self.faults, stop=self.stop,
                                  beam_size=self.codec.beam_size if final else 1, final=final)
        except Stopped as stopped:
            p.stop_reason = f"{stopped} during the {'final ' if final else ''}eval"
            if final:
                log.warning("stopped during the final eval: the checkpoint holds the refit codebooks; a run "
                            "resumed from it does the final eval")
            return
        if result is not None:  # the checkpoints say how good the codec was: the tools that load it tell
            self.checkpointer.last_eval = {"step": p.step, "rel_mse": result["rel_mse"], "final": final}
        if final:
            p.end_of_schedule.append("final eval")

    def maybe_save(self) -> None:
        """A checkpoint every --save_every steps while training goes on; the last one is save_last's."""
        p = self.progress
        if p.stop_reason is None and p.step % self.cfg.run.save_every == 0:
            self.save()

    def save_last(self) -> None:
        """The run's last checkpoint, unless there is nothing new to keep: no step trained (a stop during the
        k-means init), nothing done since the checkpoint resumed from, or a write that failed."""
        p = self.progress
        if p.step and not self.write_failed and self.saved != (p.step, tuple(p.end_of_schedule)):
            self.save()

    def save(self) -> None:
        p = self.progress
        p.time_spent, p.seconds_per_frame = self.schedule.spent(), self.schedule.per_frame
        try:
            with p.phase_of("checkpoint"):  # the others wait for rank 0's write
                path = self.checkpointer.save(self.model, self.optimizer, self.scaler, p,
                                              before_write=self.faults.before_write)
        except TransientFault as e:  # on every rank together: rank 0 sent the outcome
            p.stop_reason, self.exit_code, self.write_failed = str(e), EXIT_FAILURE, True
            log.error("%s: stopping", e)
            return
        self.saved = (p.step, tuple(p.end_of_schedule))
        if path is not None:
            self.metrics.write("checkpoint", p.step, path=str(path))
            log.info("checkpoint: %s", path)

    # ---- tear down

    def finish(self) -> int:
        p = self.progress
        if self.bar is not None:
            self.bar.close()
        self.metrics.write("stop", p.step, reason=p.stop_reason)
        self.stop.settle(self.exit_code)  # the outcome is saved: a signal from here on does not change it
        p.phase = "teardown"
        final_barrier(self.ctx, self.cfg.dist.sync_timeout)
        if self.exit_code == EXIT_OK:
            log.info("finished at step %d: %s", p.step, p.stop_reason)
            if set(END_OF_SCHEDULE) <= set(p.end_of_schedule):  # the codec is done: say what comes next
                self.say_next_steps()
        elif self.write_failed:
            log.error("stopped at step %d: %s", p.step, p.stop_reason)
        else:
            log.error("%s (more than --max_bad_steps %d): checkpoint written, stopping; lower --lr or check the data",
                      p.stop_reason, self.cfg.optim.max_bad_steps)
        return self.exit_code

    def say_next_steps(self) -> None:
        """The commands that take a finished run on, with its paths: its report, and the codes of its data."""
        run, data = shlex.quote(str(self.folder.root.absolute())), shlex.quote(self.data.identity["data_dir"])
        checkout = Path(__file__).resolve().parent  # the tools run as modules of the checkout
        log.info("next%s: python -m tools.report %s plots the run and sums it up; python -m tools.encode --checkpoint "
                 "%s --data_dir %s --split %s --output_dir codes writes the codes of its training data",
                 "" if Path.cwd() == checkout else f", from {shlex.quote(str(checkout))}", run, run, data,
                 shlex.quote(self.cfg.data.train_split))

    def lost_peer(self, error: Exception) -> DistributedFailure | None:
        """An exception on one of several ranks, judged by which peers are alive, not by its text (a collective in
        a compiled step fails in the compiler's words): the watchdog names a lost peer and exits the process
        (code 3); None when every peer is seen alive (the error is this rank's own); else a failure naming the
        peers not seen alive in the watchdog's time."""
        p = self.progress
        log.error("rank %d at step %d (%s): %s: %s; asking the watchdog whether every peer is alive", self.ctx.rank,
                  p.step, p.raised_in or p.phase, type(error).__name__, error)
        p.phase = FAILED
        silent = self.watchdog.lost_peers()
        if not silent and isinstance(error, torch.distributed.DistError):  # a collective's own failure, by its type
            return DistributedFailure(f"rank {self.ctx.rank} stopped at step {p.step}: a collective failed with every "
                                      f"peer alive (a network fault or a timeout): {error}")
        if not silent:
            log.error("rank %d: every peer is alive: the error is this rank's own", self.ctx.rank)
            return None
        return DistributedFailure(f"rank {self.ctx.rank} stopped at step {p.step}: rank(s) {silent} not seen alive "
                                  f"for {self.cfg.dist.sync_timeout}s after {type(error).__name__}: {error}")

    def close(self) -> None:
        self.progress.phase = "teardown"
        if self.batches is not None:
            self.batches.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.metrics.close()
        if not self.failed:  # tearing down groups with a lost peer can block; the process exit frees them
            destroy()
        self.output.release()


def set_threads(flag: int | None, device: torch.device, resume: Resume | None) -> None:
    """torch's CPU threads: on a CPU the count the resumed run computed with, else the cores this run can get
    (training/threads.py); on a GPU --threads alone."""
    set_cpu_threads(device, log, flag, recorded=resume.state.get("threads") if resume is not None else None)


def keep_schedule(cfg: TrainConfig, resume: Resume) -> OptimConfig:
    """The resumed run's optimisation settings: its checkpoint's, but for the flags given (training/config.py)."""
    optim, said = resumed_optim(cfg.optim, resume.state.get("config") or {}, cfg.typed)
    for line in said:
        log.info("resumed run: %s", line)
    return optim


def setup_logging(rank: int) -> None:
    log_to_stderr(f"rank{rank}", logging.INFO if rank == 0 else logging.WARNING)
    from loguru import logger  # vector-quantize-pytorch logs through loguru

    logger.remove()
    logger.add(lambda message: write_line(str(message), sys.stderr, end=""), level="ERROR")


def main(argv=None, *, script: bool = False) -> int:
    """script: the process ends with main, and ignores the stop signals from its return on, so that a signal during
    its exit cannot change the exit code (a default handler would make it 143); a caller in the same process gets
    its previous handlers back."""
    cfg = parse_args(argv)
    stop = StopRequest().install()
    try:
        return train(cfg, stop)
    except (BadInputError, TransientFault) as e:
        log.error("%s", e)
        return e.exit_code
    except DistributedFailure as e:
        log.error("distributed failure: %s", e)
        return e.exit_code
    except Exception:
        log.exception("training failed")
        return EXIT_FAILURE
    finally:
        stop.restore(ignore=script)
        free_destroyed_groups()
        if script:  # the process ends with main: its exit need not walk every object for cycles, several times
            gc.freeze()  # (seconds on a loaded machine: benchmarks/README.md, "Stops before the first step")


if __name__ == "__main__":
    report_crashes()
    end_process(main(script=True))
