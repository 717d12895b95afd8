"""Evaluation on every rank: sums over this rank's held-out data, agreed on and reduced across ranks.

The evals during training score fixed windows of held-out utterances (fast, resident on the device); the final
eval scores whole held-out utterances, encoded and decoded as tools.encode and `tools.encode decode` do (codes
from the codec's beam search, each utterance's tail padded as theirs), so its rel_mse is the one a user gets from
the codes and the one the quality tables give. Every `eval` event says which (`scored`).

Each rank evaluates its own share with no collective, so a failure there cannot
hang a peer; the ranks then agree over the control plane whether every one
succeeded, and all-reduce the sums (errors, counts, code histograms), never
per-frame outputs. An eval that failed anywhere is skipped everywhere, logged,
and training goes on. A rank asked to stop leaves its windows between two
batches, or at once on a signal (its share changes no state); the same exchange
tells the others, and every rank raises Stopped.

When the held-out split's phone labels lie beside its features (`{split}.phn`: data/training_data.py
EvalPhones), the final eval also sums, per level, the joint counts of phones and codes (a [levels, phones,
codebook size] table appended to the same all-reduce) and reports per level PNMI, phone purity and cluster
purity (models/unit_quality.py), as tools.evaluate --alignments scores each level alone.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from data.alignments import labels_at_code_rate
from data.audio.pass_plan import length_sorted_batches
from data.training_data import EvalPhones, EvalWindows
from errors import BadInputError
from models.codebook_ops import dead_code_counts
from models.codec import RVQCodec
from models.codes import code_frames, decode_utterance
from models.metrics import EvalSums
from training.codec_passes import encode_batch
from training.distributed import DistContext, agree, all_reduce_sum, exchange, raise_together
from training.signals import Chunks, Interrupted, Stopped, StopRequest, stop_reason

log = logging.getLogger(__name__)

LOW_USAGE = 0.2  # a level that uses less than this share of its codes on held-out data is warned about


@torch.no_grad()
def evaluate_shard(model: RVQCodec, windows: EvalWindows, device: torch.device, amp_dtype,
                   batch_frames: int, beam_size: int = 1, between=None) -> EvalSums:
    """Sums over this rank's held-out windows, `batch_frames` frames per forward pass, codes from a beam search
    `beam_size` wide; no collectives. between(): called before each batch; it may raise to leave the eval."""
    config = model.config
    sums = EvalSums(config.feature_dim, config.num_quantizers, config.codebook_size, device)
    per_batch = max(1, batch_frames // windows.length)
    model.eval()  # the unwrapped module in eval mode: no EMA update, none of the quantizer's collectives
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for x in windows.batches(device, per_batch):
                if between is not None:
                    between()
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    out = model(x, beam_size=beam_size)
                sums.add(x, out.reconstruction.float(), out.codes)
    finally:
        model.train()
    return sums


@torch.no_grad()
def score_utterances(model: RVQCodec, windows: EvalWindows, device: torch.device, batch_frames: int,
                     beam_size: int, between=None) -> EvalSums:
    """Sums over this rank's whole held-out utterances picked for the final eval (`windows.whole`): encoded in
    length-sorted batches of at most `batch_frames` padded frames, as tools.encode encodes a split, and decoded
    as `tools.encode decode` does; an utterance with a NaN or Inf frame is left out. between(): before each
    batch. With `windows.phones`, each code frame's phone label (that of its first feature frame) is counted with
    its codes."""
    config = model.config
    phones = windows.phones
    sums = EvalSums(config.feature_dim, config.num_quantizers, config.codebook_size, device,
                    phones=len(phones.phones) if phones is not None else 0)
    store, whole = windows.store, windows.whole
    model.eval()
    try:
        for batch in length_sorted_batches(code_frames(store.lengths[whole], config.downsample) * config.downsample,
                                           batch_frames):
            if between is not None:
                between()
            utterances = [(i, np.asarray(store.utterance(int(whole[i])), dtype=np.float32)) for i in batch]
            utterances = [(i, u) for i, u in utterances if len(u) and np.isfinite(u).all()]
            encoded = encode_batch(model, [u for _, u in utterances], beam_size=beam_size)
            for (i, features), codes in zip(utterances, encoded):
                labels = None if phones is None else labels_at_code_rate(phones.labels[i], config.downsample)
                add_whole_utterance(sums, model, features, codes, device, labels)
    finally:
        model.train()
    return sums


@torch.no_grad()
def add_whole_utterance(sums: EvalSums, model: RVQCodec, features: np.ndarray, codes: np.ndarray,
                        device: torch.device, labels: np.ndarray | None = None) -> None:
    """One whole utterance into `sums`: its codes [T', q] decoded as `tools.encode decode` decodes them (cut back
    to its T frames), scored against its features [T, D]. The final eval's scoring, and tools.evaluate's.
    labels: the phone id of each of its T' code frames, for sums that count phones."""
    reconstruction = decode_utterance(model, codes, len(features))
    sums.add(torch.tensor(np.asarray(features, dtype=np.float32), device=device),
             torch.from_numpy(reconstruction).to(device), torch.from_numpy(np.asarray(codes, np.int64)).to(device),
             None if labels is None else torch.from_numpy(np.asarray(labels, np.int64)).to(device))


def utterance_batches(windows: EvalWindows, downsample: int, batch_frames: int) -> int:
    lengths = code_frames(windows.store.lengths[windows.whole], downsample) * downsample
    return len(length_sorted_batches(lengths, batch_frames))


def evaluate(model: RVQCodec, windows: EvalWindows, ctx: DistContext, *, amp_dtype, batch_frames: int, step: int,
             metrics, faults, stop: StopRequest, beam_size: int = 1, final: bool = False) -> dict | None:
    """Eval on all ranks, written to `metrics` as an `eval` event; None (and an `eval_failed` event) when it
    failed on any rank, in which case every rank skipped it. beam_size: the codes' (1: the nearest code at each
    level, as training picks them; the codec's `beam_size`: as `encode` gives them). A stop requested on any
    rank raises Stopped on every rank (nothing written). final: the end of the schedule's eval, on whole
    utterances (`score_utterances`), which says when it starts and shows a bar on rank 0; else windows."""
    sums = vector = None
    stopped = False
    scored = "whole utterances" if final else f"{windows.length}-frame windows"
    if final:
        batches = utterance_batches(windows, model.config.downsample, batch_frames)
        whole = windows.store.lengths[windows.whole]
        log.info("final eval at step %d: %d whole held-out utterances (%d frames) on this rank in %d batch(es), "
                 "encoded and decoded as tools.encode does, codes from a beam search %d wide", step, len(whole),
                 int(whole.sum()), batches, beam_size)
    else:
        batches = math.ceil(len(windows.utterances) / max(1, batch_frames // windows.length))
    try:
        faults.in_eval(step)
        # this rank's part changes no state and holds no collective: a signal abandons it at once, mid-batch
        with stop.abandoning("the eval"), Chunks("final eval", total=batches, unit="batch", ctx=ctx, stop=stop,
                                                   agreed=False, show=final) as chunks:
            if final:
                sums = score_utterances(model, windows, ctx.device, batch_frames, beam_size, between=chunks)
            else:
                sums = evaluate_shard(model, windows, ctx.device, amp_dtype, batch_frames, beam_size, between=chunks)
        vector = sums.vector()
    except (Stopped, Interrupted):  # the exchange below carries this rank's stop to every rank
        stopped = True
    except Exception as e:  # noqa: BLE001 - reported, agreed on, and training goes on
        log.error("eval at step %d failed on rank %d: %r", step, ctx.rank, e)
    # a rank may have left its share for a peer's stop (read by its watchdog): the stop is the requesting ranks'
    table = exchange(ctx, [vector is None and not stopped, stopped, stopped and bool(stop)])
    if table[:, 1].any():
        stopping = [r for r, flag in enumerate(table[:, 2]) if flag > 0]
        log.info("eval at step %d left unfinished on every rank: a stop was requested on rank(s) %s", step, stopping)
        raise Stopped(stop_reason(ctx, stop, stopping))
    failed = [r for r, flag in enumerate(table[:, 0]) if flag > 0]
    if failed:
        return skipped(metrics, step, failed)
    sums.load_vector(all_reduce_sum(ctx, vector))  # a failed collective is a lost peer, not a failed eval
    try:  # from the reduced sums, the same on every rank: it fails on all of them alike (no frames evaluated...)
        result = {**sums.result(model.config.downsample), "dead_codes": dead_code_counts(model),
                  "beam_size": beam_size, "scored": scored}
    except Exception as e:  # noqa: BLE001 - as above, with no need to agree
        log.error("eval at step %d failed on every rank: %r", step, e)
        return skipped(metrics, step, list(range(ctx.world_size)))
    metrics.write("eval", step, **result)
    log.info("eval at step %d on %s%s: rel_mse %.4f, cosine %.4f, code usage %s, dead codes %s, %.0f bits/frame",
             step, scored, f" (codes from a beam search {beam_size} wide)" if beam_size > 1 else "", result["rel_mse"],
             result["cosine"], result["code_usage"], result["dead_codes"], result["bits_per_frame"])
    if "pnmi" in result:
        log.info("eval at step %d, per level against the %d phones of %s: PNMI %s, phone purity %s, cluster purity "
                 "%s", step, result["phones"], windows.phones.path,
                 *(", ".join("-" if v is None else f"{v:.4f}" for v in result[key])
                   for key in ("pnmi", "phone_purity", "cluster_purity")))
    low = [level for level, usage in enumerate(result["code_usage"]) if usage < LOW_USAGE]
    if low:
        log.warning("eval at step %d: level(s) %s use less than %.0f%% of their codes on held-out data (usage %s): "
                    "codebook collapse", step, low, 100 * LOW_USAGE, [result["code_usage"][level] for level in low])
    return result


def agree_on_phones(ctx: DistContext, phones: EvalPhones | None) -> None:
    """Before the first step, on every rank: the held-out split's phone labels are usable and the same file on
    every rank (the final eval's all-reduce appends a table as wide as their phones), or BadInputError on every
    rank together (exit 2), naming the first bad utterance as the file's check found it."""
    table = agree(ctx, None if phones is None else (str(phones.path), phones.digest, phones.error))
    errors = [(rank, found[2]) for rank, found in enumerate(table) if found is not None and found[2]]
    if errors:
        rank, error = errors[0]
        raise_together(ctx, error, BadInputError, rank)
    differ = [rank for rank, found in enumerate(table) if (found and found[1]) != (table[0] and table[0][1])]
    if differ:
        seen = ", ".join(f"rank {r}: {'none' if table[r] is None else table[r][0] + ' sha1 ' + table[r][1][:12]}"
                         for r in [0, *differ])
        raise BadInputError(f"the held-out split's phone labels differ between ranks ({seen}): give every node the "
                            "same file, on a filesystem they share, or none")


def skipped(metrics, step: int, failed: list[int]) -> None:
    """The `eval_failed` event of an eval that every rank skipped."""
    metrics.write("eval_failed", step, ranks=failed)
    log.warning("eval at step %d skipped on every rank: it failed on rank(s) %s", step, failed)
    return None
