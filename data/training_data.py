"""The training data as the trainer sees it: its flags, the stores opened and checked, and the batch source.

`DataConfig` is the trainer's data section: each field is the flag of the same
name (`--batch_size` ...), help text in its metadata (read by training/config.py).
`open_training_data` finds, validates and shards the features from their metadata
(every problem a BadInputError, exit 2, before anything is written; frames are
checked as they are read, data/bad_crops.py); `batch_source` picks where
this rank's batches come from: the device cache, the prefetcher, or the store
read on the main thread.
"""
from __future__ import annotations

import hashlib
import logging
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from data.alignments import read_alignments
from data.bad_crops import finite_crops
from data.batch_plan import BatchPlan, eval_windows, pick_utterances, pick_windows, shard_indices
from data.crops import CropReader, HostBatches
from data.demo_corpus import ensure_demo_corpus
from data.device_cache import DeviceFeatureCache
from data.feature_settings import describe, dump_feature_settings, settings_differ
from data.setting_changes import changes
from data.prefetcher import Prefetcher
from data.stores import HOLDOUT, TRAIN_SPLIT, VALID_SPLIT, FeatureStore, open_stores, save_manifest, store_identity
from errors import BadInputError

log = logging.getLogger(__name__)

# The automatic segment length: the longest of these that leaves out few training frames (those of utterances
# shorter than it, never sampled), so that short utterances are trained on; shorter crops cost speed (more crop
# edges per frame) and their first and last frames are in fewer crops (benchmarks/README.md)
AUTO_LENGTHS = (128, 64, 32, 16)
AUTO_COVERAGE = 0.98  # the share of training frames the automatic length must reach
# Crops of AUTO_LENGTHS[0] frames per rank per step when --batch_size is not given, by device type: on a CPU more
# updates of fewer frames train a better codec in a fixed time (benchmarks/README.md, "Choosing the batch");
# a GPU step of 2,048 frames is mostly fixed overhead
DEFAULT_BATCH = {"cpu": 16, "cuda": 64}


@dataclass(kw_only=True)
class DataConfig:
    data_dir: str | None = field(default=None, metadata={
        "help": "feature store (fairseq dump or folder of [T, D] .npy/.pt); none: the built-in demo corpus"})
    train_split: str = field(default=TRAIN_SPLIT, metadata={"help": "the split trained on, in --data_dir"})
    valid_split: str = field(default=VALID_SPLIT, metadata={
        "help": f"when '{VALID_SPLIT}' is absent, {HOLDOUT:.0%} of training utterances are held out; another name "
                "must exist"})
    batch_size: int | None = field(default=None, metadata={
        "help": f"crops per rank per step at --segment_length; frames per step stay this x that (with the automatic "
                f"length, this x {AUTO_LENGTHS[0]}: a shorter length gets more crops); none: "
                f"{DEFAULT_BATCH['cpu']} on a CPU, {DEFAULT_BATCH['cuda']} on a GPU"})
    segment_length: int | None = field(default=None, metadata={
        "help": f"frames per crop (the base length); none: the longest of {list(AUTO_LENGTHS)} that leaves out at "
                f"most {1 - AUTO_COVERAGE:.0%} of the training frames (in utterances shorter than it)"})
    multi_length_training: bool = field(default=False, metadata={
        "help": "draw each step's length from --segment_lengths"})
    segment_lengths: list[int] = field(default_factory=lambda: [64, 128, 256, 512], metadata={
        "help": "comma-separated frames per crop, one drawn per step with --multi_length_training (frames per step "
                "stay --batch_size x --segment_length)"})
    num_workers: int = field(default=0, metadata={
        "kind": "nonnegative", "help": "background threads assembling batches (0: on the main thread unless --prefetch)"})
    pin_memory: bool = field(default=False, metadata={
        "switch": True, "help": "assemble host batches in pinned memory, for asynchronous copies to the GPU"})
    persistent_workers: bool = field(default=False, metadata={
        "switch": True, "help": "keep the worker threads across epochs instead of starting them anew"})
    use_gpu_cache: bool = field(default=False, metadata={"help": "pack this rank's features into one device tensor"})
    gpu_cache_gb: float = field(default=8.0, metadata={"kind": "positive", "help": "device cache budget per rank"})
    prefetch: bool = field(default=False, metadata={"help": "assemble batches ahead in a background thread"})
    prefetch_depth: int = field(default=4, metadata={"help": "batches the prefetcher keeps ready ahead of the step"})
    # 32768 frames: an eval is about 3% of the time of 100 default steps on a 2-core CPU (README, Data)
    eval_frames: int = field(default=32768, metadata={
        "kind": "nonnegative", "help": "held-out frames per eval over all ranks, in windows of the shortest "
                                       "segment length picked once by --seed and kept on the device; the final "
                                       "eval scores whole utterances holding as many (0: every held-out window, "
                                       "read at each eval, and every utterance)"})

    @property
    def frames_per_step(self) -> int:
        """Frames per rank per micro-batch, whatever the step's segment length."""
        return self.batch_size * self.segment_length

    @property
    def train_lengths(self) -> list[int]:
        return list(self.segment_lengths) if self.multi_length_training else [self.segment_length]

    def fit_to(self, lengths: np.ndarray, multiple_of: int, device_type: str) -> "DataConfig":
        """This config with the batch size and the automatic segment length decided, from the device type and
        the training utterances' lengths (the same on every rank): a shorter automatic length gets as many more
        crops as keep the frames per step. What was given is kept."""
        batch = self.batch_size
        if batch is None:
            batch = DEFAULT_BATCH.get(device_type, DEFAULT_BATCH["cuda"])
            log.info("batch size %d (no --batch_size: the default on a %s)", batch, device_type.upper())
        if self.segment_length is not None:
            return dataclasses.replace(self, batch_size=batch)
        candidates = sorted({L - L % multiple_of for L in AUTO_LENGTHS if L >= multiple_of}, reverse=True)
        lengths = np.asarray(lengths, dtype=np.int64)
        reach = {L: float(lengths[lengths >= L].sum() / max(1, lengths.sum())) for L in candidates}
        length = next((L for L in candidates if reach[L] >= AUTO_COVERAGE), candidates[-1])
        crops = max(1, batch * AUTO_LENGTHS[0] // length)
        log.info("segment length %d (automatic: %.1f%% of the training frames are in utterances of at least %d "
                 "frames%s), %d crops per step: the frames of batch size %d at %d frames a crop", length,
                 100 * reach[length], length,
                 "" if length == candidates[0] else f"; {100 * reach[candidates[0]]:.1f}% at {candidates[0]}",
                 crops, batch, AUTO_LENGTHS[0])
        batch = crops
        return dataclasses.replace(self, segment_length=length, batch_size=batch)


PHONE_LABELS = "{split}.phn"  # the held-out split's frame labels, beside its features: the final eval's PNMI


@dataclass
class EvalPhones:
    """The held-out split's phone labels (`{split}.phn` in --data_dir, beside its features), for the final eval's
    PNMI: every phone of the file, sorted (the same ids on every rank), and the frame labels of the utterances
    the final eval scores on this rank (EvalWindows.whole, in order); or why they cannot be used (`error`,
    agreed on by every rank before the first step: training/evaluate.py agree_on_phones). `digest`: the file's,
    which every rank must share."""

    path: Path
    digest: str
    phones: list[str] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    error: str | None = None


def held_out_phones(data_dir: Path, split: str, valid: FeatureStore, mine: np.ndarray) -> EvalPhones | None:
    """`{split}.phn` beside the held-out features read and checked against every held-out utterance (a line per
    utterance, its frames within one: data/alignments.py), keeping the labels of utterances `mine` (indices into
    `valid`); None when there is no such file. A bad file is recorded, not raised: every rank raises together."""
    path = Path(data_dir) / PHONE_LABELS.format(split=split)
    if not path.is_file():
        return None
    raw = path.read_bytes()
    found = EvalPhones(path, hashlib.sha1(raw).hexdigest())
    try:  # frame labels carry no times: the frame rate is not used
        alignments = read_alignments(path, valid.lengths, None, 50.0, describe=valid.name)
    except BadInputError as e:
        found.error = (f"{e}. {path} is read as the held-out split's phone labels, for the final eval's PNMI (one "
                       "line per utterance in the split's order, one label per feature frame): fix it, or move it "
                       "away to train without PNMI")
        return found
    found.phones = alignments.phones
    found.labels = [alignments.labels[int(i)] for i in mine]
    return found


@dataclass
class EvalWindows:
    """This rank's held-out windows: crop `i` is frames [starts[i], starts[i] + length) of utterances[i]."""

    store: FeatureStore  # this rank's held-out utterances
    utterances: np.ndarray
    starts: np.ndarray
    length: int
    whole: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # utterances the final eval scores
    resident: bool = False  # read once, on the first eval, and kept on the device
    phones: EvalPhones | None = None  # the phone labels of `whole`: the final eval's PNMI
    _crops: torch.Tensor | None = field(default=None, repr=False)

    def batches(self, device: torch.device, per_batch: int):
        """The windows as `[<= per_batch, length, D]` float32 tensors on the device; a window with a NaN or
        Inf frame is left out."""
        if self.resident:
            if self._crops is None:
                with self.store.scattered_reads():
                    crops = torch.from_numpy(CropReader(self.store).read(self.utterances, self.starts, self.length))
                self._crops = crops[finite_crops(crops)].to(device)
            yield from self._crops.split(per_batch) if len(self._crops) else ()  # a rank may hold none
            return
        reader = CropReader(self.store)
        for i in range(0, len(self.utterances), per_batch):
            crops = reader.read(self.utterances[i : i + per_batch], self.starts[i : i + per_batch], self.length)
            x = torch.from_numpy(crops).to(device)
            x = x[finite_crops(x)]
            if len(x):
                yield x


@dataclass
class TrainingData:
    config: DataConfig  # the flags, with the automatic segment length decided
    train: FeatureStore  # every training utterance
    shard: FeatureStore  # this rank's training utterances, in the plan's order
    plan: BatchPlan
    eval: EvalWindows
    identity: dict = field(default_factory=dict)  # what these data are (data_identity): a checkpoint records it
    pending_manifests: list = field(default_factory=list)  # (path, lengths, dim, digest) not yet written

    def save_manifests(self) -> None:
        """Write the lengths manifests of read-only folder stores (into the output dir)."""
        for path, lengths, dim, digest in self.pending_manifests:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_manifest(path, lengths, dim, digest)
            log.info("the data folder is read-only: its lengths manifest is in %s", path)
        self.pending_manifests = []


def open_training_data(cfg: DataConfig, *, rank: int, world_size: int, seed: int, multiple_of: int,
                       device_type: str, manifest_dir: Path | None = None,
                       save_manifests: bool = True) -> TrainingData:
    """Find, validate and shard the features; every problem is a BadInputError (exit 2), but for those of the
    held-out split's phone labels, recorded in `eval.phones` for every rank to agree on (the trainer raises them
    together: training/evaluate.py agree_on_phones). A read-only folder store's lengths manifest is saved in
    `manifest_dir` (the output dir) once every check has passed, or, with save_manifests=False, when the caller
    says (`TrainingData.save_manifests`: the trainer, once its output dir is its own)."""
    data_dir = cfg.data_dir
    if data_dir is None:
        data_dir = ensure_demo_corpus()
        log.info("no --data_dir given: training on the built-in DEMO corpus (synthetic speech-like 160-d "
                 "features) in %s", data_dir)
    pending = []
    train, valid, holdout_note = open_stores(data_dir, cfg.train_split, cfg.valid_split, seed=seed,
                                             manifest_dir=manifest_dir, pending=pending)
    if holdout_note:
        log.info("%s", holdout_note)
    cfg = cfg.fit_to(train.lengths, multiple_of, device_type)
    plan = BatchPlan(train.lengths, segment_lengths=cfg.train_lengths, frames_per_step=cfg.frames_per_step,
                     seed=seed, rank=rank, world_size=world_size, multiple_of=multiple_of)
    log.info("train: %s, %d utterances, %d frames, dim %d; held out: %d utterances",
             train.description, len(train), train.total_frames, train.dim, len(valid))
    if plan.too_short:
        log.warning("%d training utterances are shorter than %d frames and are never sampled",
                    plan.too_short, min(cfg.train_lengths))
    if plan.dropped_lengths:
        log.warning("segment length(s) %s dropped: not every rank has an utterance that long; training on %s",
                    plan.dropped_lengths, plan.segment_lengths)
    length = min(plan.segment_lengths)
    check_eval_windows(valid, length, cfg, holdout=holdout_note is not None)
    valid_shard = valid.subset(shard_indices(len(valid), rank, world_size), "held out")
    utterances, starts, skipped = eval_windows(valid_shard.lengths, length)
    if skipped:
        log.warning("%d held-out utterances on this rank are shorter than %d frames and are not evaluated",
                    skipped, length)
    picked = pick_windows(len(utterances), cfg.eval_frames, length, seed=seed, rank=rank, world_size=world_size)
    log.info("eval: %d of this rank's %d held-out windows of %d frames%s", len(picked), len(utterances), length,
             ", every eval reads them" if cfg.eval_frames == 0 else
             f", picked once by --seed (--eval_frames {cfg.eval_frames} over all ranks) and kept on the device")
    shard = train.subset(shard_indices(len(train), rank, world_size), "this rank's shard")
    whole = pick_utterances(valid_shard.lengths, cfg.eval_frames, seed=seed, rank=rank, world_size=world_size)
    phones = None
    if holdout_note is None:
        phones = held_out_phones(Path(data_dir), cfg.valid_split, valid,
                                 shard_indices(len(valid), rank, world_size)[whole])
        if phones is not None and phones.error is None:
            log.info("phone labels: %s, %d phones: the final eval reports PNMI and purities per level", phones.path,
                     len(phones.phones))
    elif (Path(data_dir) / PHONE_LABELS.format(split=cfg.train_split)).is_file():
        log.info("%s is not read: the held-out utterances are part of '%s', whose labels grow with the corpus; "
                 "for PNMI in the final eval, give a '%s' split with its %s", Path(data_dir) /
                 PHONE_LABELS.format(split=cfg.train_split), cfg.train_split, cfg.valid_split,
                 PHONE_LABELS.format(split=cfg.valid_split))
    eval_set = EvalWindows(valid_shard, utterances[picked], starts[picked], length, whole=whole,
                           resident=cfg.eval_frames > 0, phones=phones)
    held = (len(valid), valid.total_frames) if holdout_note else (0, 0)  # a holdout is part of the training split
    identity = data_identity(cfg.data_dir, data_dir, store_identity(
        train, cfg.train_split, len(train) + held[0], train.total_frames + held[1]), train.dim)
    data = TrainingData(cfg, train, shard, plan, eval_set, identity, pending)
    if save_manifests:  # the data passed every check: the output dir may be written
        data.save_manifests()
    return data


def data_identity(given: str | None, data_dir: str | Path, store: dict, dim: int) -> dict:
    """What the training data are, as a checkpoint records them: the feature settings (tools.extract's notes, or
    the demo corpus), the dimension, the store (data/stores.py store_identity), and the folder (for messages
    only: a copy of the store elsewhere is the same data). The feature statistics are the codec's own."""
    return {"features": dump_feature_settings(given, store["split"]), "dim": int(dim), "store": store,
            "data_dir": str(Path(data_dir).resolve())}


def data_differences(trained: dict, now: dict) -> list[str]:
    """`what: trained -> now` for each part of two data identities that differs (none: the same data)."""
    was, new = trained.get("features", {}), now.get("features", {})
    if was.get("feature") != new.get("feature"):
        differ = changes({"features": was}, {"features": new}, show=describe)
    else:
        differ = [f"features: {settings_differ(was, new)}"] if settings_differ(was, new) else []
    differ += changes(trained, now, ["dim"], show=str)
    was, new = trained.get("store", {}), now.get("store", {})
    differ += changes(was, new, ["split"]) + changes(was, new, ["files", "utterances", "frames"], show=str)
    return differ


def check_eval_windows(valid: FeatureStore, length: int, cfg: DataConfig, *, holdout: bool) -> None:
    """A BadInputError unless some held-out utterance holds an eval window of `length` frames. Decided from every
    held-out utterance, not this rank's, so every rank decides alike; a rank with no window of its own evaluates
    nothing and joins the others' sums."""
    longest = int(valid.lengths.max()) if len(valid) else 0
    if longest >= length:
        return
    if holdout:
        where = f"the {len(valid)} utterance(s) held out of '{cfg.train_split}' (there is no '{cfg.valid_split}' split)"
        choose = f"add a '{cfg.valid_split}' split"
    else:
        where = f"the held-out split '{cfg.valid_split}' ({valid.description}, {len(valid)} utterance(s))"
        choose = "choose a --valid_split"
    lower = "--segment_lengths" if cfg.multi_length_training else "--segment_length"
    raise BadInputError(
        f"no held-out window to evaluate: the longest utterance of {where} has {longest} frames, fewer than the "
        f"eval window of {length} frames (the shortest segment length); "
        + (f"lower {lower} to at most {longest}, or " if longest else "")
        + f"{choose} with utterances of at least {length} frames")


def batch_source(cfg: DataConfig, store: FeatureStore, plan, device: torch.device, *, start_step: int,
                 cache_dtype: torch.dtype, show_progress: bool):
    """This rank's batches, `get(step) -> (StepBatch, tensor on device)`, from the source the flags choose."""
    prefetch = dict(start_step=start_step, depth=cfg.prefetch_depth, workers=cfg.num_workers,
                    pin_memory=cfg.pin_memory, persistent_workers=cfg.persistent_workers)
    streaming = cfg.prefetch or cfg.num_workers > 0
    if cfg.use_gpu_cache:  # with --prefetch, what does not fit under --gpu_cache_gb is prefetched
        return DeviceFeatureCache(store, plan, device, max_bytes=cfg.gpu_cache_gb * 1e9, dtype=cache_dtype,
                                  show_progress=show_progress, stream=prefetch if streaming else None)
    if streaming:
        return Prefetcher(store, plan, device, **prefetch)
    return HostBatches(store, plan, device, pin_memory=cfg.pin_memory)
