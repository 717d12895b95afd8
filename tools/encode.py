"""A feature store -> RVQ codes with a trained codec, and codes -> features again.

    python -m tools.encode --checkpoint RUN_DIR_OR_CKPT --data_dir FEATS --split train --output_dir CODES
    python -m tools.encode decode --checkpoint RUN_DIR_OR_CKPT --codes_dir CODES --split train --output_dir RECON

Rank RANK of NSHARD encodes its contiguous share of the split's utterances (all its shards, in order), as
in fairseq's simple_kmeans, and opens only the shards of the store that share reads from. Written into
--output_dir, for NAME = {split}_{rank}_{nshard}:

- `NAME.codes.npy`: [code frames, levels], every utterance's codes in order; int16 when every code fits
  (codebook_size <= 32768), else int32;
- `NAME.codes.len`: code frames per utterance, one per line;
- `NAME.codes.json`: the settings (checkpoint, step, the digest of its weights, levels, codebook size,
  downsample, dtype, the features as tools.extract noted them, the share, frame counts), how the features were
  found to be the codec's (`feature_check`) and each utterance's feature frame count (`feature_frames`);
- `NAME.codes.tsv`: when the store was written by tools.extract, the audio files of these utterances in
  order (a fairseq manifest);
- `NAME.km` with `--km [LEVEL]`: fairseq's label file, one line of space-separated codes of one level per
  utterance (HuBERT's dump_km_label.py).
- `NAME.codes.parquet` with `--parquet`: a row per utterance, its `key` (its .codes.tsv file, else its index in
  the split) and its codes at each level (`level_1` ... `level_Q`), as datasets.load_dataset("parquet") reads it;
  written once the shard is finished, or when a finished shard is found without it (data/codes_parquet.py).
- `NAME.codes.skipped`: the utterances whose features hold NaN or Inf, one a line (their index in the split, a
  tab, the reason): each keeps its place in the files above with codes of -1 (no code), and is named in a
  warning.

`--num_quantizers q` keeps the first q levels (a lower bitrate); `--kbps R` the first levels that make R kilobits
per second of audio (rvq_tokenizer/codes_spec.py levels_for_kbps). An utterance of T frames gives
ceil(T / downsample) code frames (models/codes.py). Utterances are encoded in chunks of about
--commit_frames feature frames, each in length-sorted batches of at most --batch_frames padded frames
(the progress bar moves with each batch); each chunk's codes are appended to NAME.codes.npy.partial and
committed (data/resumable_shard.py), so that the same command run again after a crash goes on from the last
commit and writes the same bytes as an uninterrupted run. A finished shard is not encoded again: the
command says so and exits 0 (--overwrite starts it over), its .km written again from its codes when --km
names another level; one written with other settings is refused. A second process on the same shard exits 2,
naming the first. Decoding writes a fairseq dump (`NAME.npy/.len`)
of the reconstructed features, cut back to each utterance's T frames when the .codes.json gives them, with the
codec that wrote them (another exits 2, naming both); it refuses an output folder where NAME.npy or NAME.len
exists (the features it would shadow) unless --overwrite. When the features the codes were encoded from are
still where the .codes.json says (`data_dir`, the split, the share), it logs the reconstruction's rel_mse and
cosine against them, as the trainer's evals score them (models/metrics.py).

The features must be those the codec was trained on, as tools.tokenize requires: where the dump has
tools.extract's notes and the checkpoint records its features, their settings must agree (exit 2 naming those
that differ), but for the dump's dtype alone (float16 or float32: read as float32, and said); otherwise the
statistics of the share's first frames must lie within PLAUSIBLE_SHIFT of those the codec was trained on
(data/feature_settings.py). --allow_feature_mismatch encodes anyway, and the .codes.json
says so. One output folder holds the codes of one codec: a shard from another checkpoint exits 2, naming both
(rvq_tokenizer/code_shard.py, data/resumable_shard.py).

--device is resolved by training/device.py; encoding runs in eval mode and float32. Exit codes: 0 done (or
already done), 2 bad arguments or data, or an output that is another's (nothing written), 1 anything else.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.dump_writer import NpyRowWriter, len_text, output_folder, publish, write_temporary
from data.manifests import manifest_lines, share_manifest, shown_name
from data.resumable_shard import split_shards
from data.shard_layout import CODES, FEATURE_DUMP
from data.stores import FeatureStore, find_split
from data.writer_lock import WriterLock
from errors import EXIT_OK, BadInputError
from models.codes import TAIL_PADDING, code_frames, decode_utterance, uncoded
from models.metrics import EvalSums
from rvq_tokenizer.code_shard import CodeShard
from rvq_tokenizer.codec_files import open_codec, recorded_digest
from rvq_tokenizer.codes_spec import CodesRequest, CodesSpec, codes_spec, describe_codes
from rvq_tokenizer.feature_check import SplitShare, check_features, open_share
from tools.cli import bad_input_exits_2, run
from tools.codes_flags import add_checkpoint_arg, add_codes_args, codes_request
from training.codec_passes import encode_in_batches
from training.device import select_device
from training.faults import FaultInjector
from training.flag_help import FlagHelpFormatter
from training.threads import set_cpu_threads

log = logging.getLogger("encode")


@dataclass(frozen=True)
class EncodeSettings:
    """What tools.encode's flags ask for."""

    checkpoint: Path  # a checkpoint file, a run's --output_dir or an export folder
    data: SplitShare
    codes: CodesRequest
    allow_feature_mismatch: bool
    commit_frames: int
    output_dir: Path
    overwrite: bool
    device: str


@dataclass(frozen=True)
class DecodeSettings:
    """What tools.encode decode's flags ask for: a shard's codes, decoded into `output_dir`."""

    checkpoint: Path
    codes: SplitShare
    output_dir: Path
    overwrite: bool
    device: str


def commit_chunks(lengths: np.ndarray, commit_frames: int, done: int) -> list[tuple[int, int, int]]:
    """(number from 1, first, end) of the chunks of utterances still to encode after the first `done`. A chunk
    holds the utterances that begin within one span of `commit_frames` frames, so the chunks are the same
    whenever the shard is resumed."""
    begins = np.cumsum(lengths) - lengths
    ends = np.append(np.flatnonzero(np.diff(begins // commit_frames)) + 1, len(lengths))
    firsts = np.concatenate([[0], ends[:-1]])
    return [(k + 1, max(int(firsts[k]), done), int(ends[k])) for k in range(len(ends)) if ends[k] > done]


def encode_store(cfg: EncodeSettings) -> int:
    device = select_device(cfg.device)
    set_cpu_threads(device, log)  # the cores it can get: on cores a neighbour keeps busy, extra threads wait
    model, state, ckpt_path = open_codec(cfg.checkpoint, device)
    data = cfg.data
    store, start, end, total = open_share(data, model.config, ckpt_path)
    spec = codes_spec(cfg.codes, model, state, ckpt_path, device)
    features, feature_check = check_features(data, state, model, store, ckpt_path,
                                             allow_mismatch=cfg.allow_feature_mismatch)
    code_lengths = code_frames(store.lengths, model.config.downsample)
    name = data.name
    settings = {**spec.settings, "features": features, "split": data.split, "rank": data.rank,
                "nshard": data.nshard, "first_utterance": start, "utterances": end - start,
                "frames": store.total_frames, "code_frames": int(code_lengths.sum())}
    shard = CodeShard.begin(cfg.output_dir, name, spec, settings, overwrite=cfg.overwrite,
                            redo="encode the shard again", parquet=cfg.codes.parquet, rows=int(code_lengths.sum()))
    if shard is None:  # finished already (its parquet written if asked for and missing)
        log.info("finished successfully")
        return EXIT_OK
    with shard:
        log.info("%s: utterances %d-%d of %d in %s -> %s/%s%s, %s", name, start, end - 1, total, data.folder,
                 cfg.output_dir, name, CODES.array, describe_codes(spec))
        shard.say_resumed("utterance", end - start)
        encode_chunks(spec, store, shard, name=name, first_utterance=start, faults=FaultInjector(data.rank),
                      commit_frames=cfg.commit_frames)
        manifest = share_manifest(data.folder, data.split, total, start, end)
        array, _, skipped = shard.finish(
            lambda frames, skipped: {
                **settings, "feature_check": feature_check, "store": store.description,
                "data_dir": str(data.folder.absolute()), "padding": TAIL_PADDING, "feature_frames": frames,
                "skipped": skipped},
            feature_frames=store.lengths, keys=None if manifest is None else manifest_lines(*manifest))
    log.info("%s%s", shard.wrote(end - start, array),
             f"; {skipped} with NaN or Inf features have codes -1, listed in {shard.skipped_list}" if skipped else "")
    log.info("finished successfully")
    return EXIT_OK


def encode_chunks(spec: CodesSpec, store: FeatureStore, shard: CodeShard, *, name: str, first_utterance: int,
                  faults: FaultInjector, commit_frames: int) -> None:
    """Encode and commit the chunks of the share (utterance `first_utterance` of the split on) after those `shard`
    holds; the bar moves with each batch. An utterance with NaN or Inf features keeps its place with codes of -1
    (models/codes.py), named in a warning and in NAME.codes.skipped: its index in the split, a tab, the reason."""
    done = int(store.lengths[: shard.done].sum())
    began, frames = time.perf_counter(), 0
    with tqdm(total=store.total_frames, initial=done, desc=f"encode {name}", unit="frame", unit_scale=True,
              dynamic_ncols=True, mininterval=1.0) as bar:
        for number, first, end in commit_chunks(store.lengths, commit_frames, shard.done):
            chunk = store.share(first, end)
            codes = encode_in_batches(spec.model, chunk, spec.levels, spec.batch_frames, spec.dtype, spec.beam,
                                      on_batch=lambda batch: bar.update(int(chunk.lengths[batch].sum())))
            lengths = shard.write(codes, chunk.lengths)
            for i in first + uncoded(codes, lengths):
                log.warning("%s has NaN or Inf values: its codes are -1 (no code), listed in %s%s; "
                            "`python -m tools.check` lists every such utterance of a dump", store.name(i), name,
                            CODES.skipped)
                shard.skip(f"{first_utterance + i}\tNaN or Inf features, codes -1: {shown_name(store.name(i))}\n")
            faults.before_commit(number)
            shard.commit(end)
            frames += chunk.total_frames
    seconds = time.perf_counter() - began
    if frames:
        log.info("encoded %d feature frames in %.1f s: %.0f frames/s", frames, seconds, frames / max(seconds, 1e-9))


def decode_codes(cfg: DecodeSettings) -> int:
    device = select_device(cfg.device)
    set_cpu_threads(device, log)
    model, state, ckpt_path = open_codec(cfg.checkpoint, device)
    name, codes_dir, output_dir = cfg.codes.name, cfg.codes.folder, cfg.output_dir
    array, lens = codes_dir / (name + CODES.array), codes_dir / (name + CODES.lengths)
    if not array.is_file() or not lens.is_file():
        raise missing_codes(cfg.codes, array, lens)
    codes = np.load(array, mmap_mode="r")
    counts = [int(n) for n in lens.read_text().split()]
    if codes.ndim != 2 or sum(counts) != codes.shape[0]:
        raise BadInputError(f"{lens.name} lists {sum(counts)} code frames but {array.name} has shape {codes.shape}")
    if not 1 <= codes.shape[1] <= model.config.num_quantizers:
        raise BadInputError(f"{array.name} has {codes.shape[1]} levels; the codec in {ckpt_path} has "
                            f"{model.config.num_quantizers}")
    meta_path = codes_dir / (name + CODES.meta)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta.get("codec_digest") not in (None, recorded_digest(state)):  # another codec's codes: noise
        raise BadInputError(f"{array} holds codes of the codec {meta.get('checkpoint')} (step {meta.get('step')}); "
                            f"the codec in {ckpt_path} (step {state.get('step')}) is another: decode them with "
                            f"--checkpoint {meta.get('checkpoint')}")
    frames = meta.get("feature_frames")
    if frames is not None and len(frames) != len(counts):
        frames = None
    output_folder(output_dir, "--output_dir")
    source = encoded_features(meta, frames, model.config.feature_dim)
    sums = EvalSums(model.config.feature_dim, codes.shape[1], model.config.codebook_size, "cpu")
    with WriterLock(FEATURE_DUMP.lock_path(output_dir, name), f"shard {output_dir / (name + FEATURE_DUMP.array)}"):
        if not cfg.overwrite:
            refuse_to_shadow(output_dir, name)
        writer = NpyRowWriter(output_dir / (name + FEATURE_DUMP.array), model.config.feature_dim)
        lengths, row = [], 0
        try:
            for i, n in enumerate(tqdm(counts, desc=f"decode {name}", unit="utt", dynamic_ncols=True,
                                       mininterval=1.0)):
                utterance_codes = codes[row : row + n]
                out = decode_utterance(model, utterance_codes, frames[i] if frames else None)
                writer.append(out)
                lengths.append(len(out))
                row += n
                if source is not None:
                    x = np.array(source.utterance(i), dtype=np.float32)  # a copy: a store's arrays are read-only
                    if np.isfinite(x).all():  # one with NaN or Inf features has codes of -1: nothing to score
                        sums.add(torch.from_numpy(x), torch.from_numpy(out),
                                 torch.from_numpy(np.asarray(utterance_codes, dtype=np.int64)))
            len_path = output_dir / (name + FEATURE_DUMP.lengths)
            publish([(write_temporary(len_path, len_text(lengths)), len_path)], (writer.finish(), writer.path))
        except BaseException:
            writer.discard()
            raise
    log.info("wrote %d utterances, %d frames of %d-d features to %s", len(lengths), sum(lengths),
             model.config.feature_dim, writer.path)
    if source is not None and float(sums.frames):
        scored = sums.result(model.config.downsample)
        log.info("reconstruction of %s: rel_mse %.4f, cosine %.4f over %d frames", source.description,
                 scored["rel_mse"], scored["cosine"], scored["frames"])
    log.info("finished successfully")
    return EXIT_OK


def encoded_features(meta: dict, frames: list[int] | None, dim: int) -> FeatureStore | None:
    """The utterances a shard's codes were encoded from (its .codes.json's data_dir, split and share), to score
    their reconstruction by; None, saying why, when the codes do not name them or they are no longer those."""
    folder, split, first = meta.get("data_dir"), meta.get("split"), meta.get("first_utterance")
    if folder is None or split is None or first is None or frames is None:
        log.info("no reconstruction error: the .codes.json does not name the features its codes were encoded from "
                 "(codes from before it did); python -m tools.evaluate scores a codec on features")
        return None
    store = find_split(Path(folder), split) if Path(folder).is_dir() else None
    share = store.share(first, first + len(frames)) if store is not None and first + len(frames) <= len(store) else None
    if share is None or share.dim != dim or share.lengths.tolist() != frames:
        log.info("no reconstruction error: split '%s' of %s no longer holds the features these codes were encoded "
                 "from", split, folder)
        return None
    return share


def missing_codes(codes: SplitShare, array: Path, lens: Path) -> BadInputError:
    """Why shard NAME's codes are not there: the split is there in another count of shards (the flags that name
    them), or it was not encoded."""
    others = [n for n in sorted(split_shards(codes.folder, codes.split, CODES, begun=False)) if n != codes.nshard]
    if others:
        flags = " or ".join(f"--nshard {n} --rank R (R from 0 to {n - 1})" for n in others)
        return BadInputError(f"--codes_dir {codes.folder} holds split '{codes.split}' in "
                             f"{' and in '.join(map(str, others))} shards, not {codes.nshard}: decode each with "
                             f"{flags}")
    return BadInputError(f"{array} or {lens.name} is missing: run python -m tools.encode first")


def refuse_to_shadow(folder: Path, name: str) -> None:
    """Decoding into a folder that holds NAME's features (an extraction's, say) would replace them with their
    lossy reconstruction: exit 2."""
    there = [folder / (name + ext) for ext in (FEATURE_DUMP.array, FEATURE_DUMP.lengths) if (folder / (name + ext)).exists()]
    if there:
        raise BadInputError(f"{there[0]} exists: decoding into {folder} would replace those features with their "
                            "reconstruction; give another --output_dir, or pass --overwrite to replace them")


def build_parser(decoding: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.encode" + (" decode" if decoding else ""),
        description=("Decode RVQ codes back to features (a fairseq dump)." if decoding else
                     "Encode a feature store to RVQ codes (`decode --help`: codes -> features)."),
        formatter_class=FlagHelpFormatter,
    )
    add_checkpoint_arg(p)
    if decoding:
        p.add_argument("--codes_dir", type=Path, required=True, help="where tools.encode wrote the codes")
        p.add_argument("--overwrite", action="store_true",
                       help="replace NAME.npy/.len in --output_dir, whatever they hold")
    else:
        p.add_argument("--data_dir", type=Path, required=True,
                       help="the feature store (as the trainer's --data_dir)")
        add_codes_args(p)
        p.add_argument("--allow_feature_mismatch", action="store_true",
                       help="encode features that do not look like the codec's (tools.extract's settings or the "
                            "statistics differ), with a warning; their codes are seldom meaningful")
        p.add_argument("--commit_frames", type=int, default=1_000_000,
                       help="feature frames between commits (codes fsynced, progress recorded): what a killed run "
                            "encodes again at most")
        p.add_argument("--overwrite", action="store_true",
                       help="delete the shard's codes, finished or partial, and encode it from the start")
    p.add_argument("--split", default="train", help="the split read")
    p.add_argument("--output_dir", type=Path, required=True, help="where the output goes")
    p.add_argument("--nshard", type=int, default=1, help="number of shards the split is cut into")
    p.add_argument("--rank", type=int, default=0, help="which shard this process handles")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    return p


def parse_args(argv=None) -> EncodeSettings | DecodeSettings:
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    decoding = bool(argv) and argv[0] == "decode"
    p = build_parser(decoding)
    args = p.parse_args(argv[1:] if decoding else argv)
    if args.nshard < 1 or not 0 <= args.rank < args.nshard:
        p.error(f"need nshard >= 1 and 0 <= rank < nshard, got nshard {args.nshard}, rank {args.rank}")
    if decoding:
        codes = SplitShare(args.codes_dir, args.split, args.nshard, args.rank)
        return DecodeSettings(args.checkpoint, codes, args.output_dir, args.overwrite, args.device)
    data = SplitShare(args.data_dir, args.split, args.nshard, args.rank)
    codes = codes_request(p, args)
    if args.commit_frames < 1:
        p.error(f"--commit_frames must be positive, got {args.commit_frames}")
    return EncodeSettings(args.checkpoint, data, codes, args.allow_feature_mismatch, args.commit_frames,
                          args.output_dir, args.overwrite, args.device)


@bad_input_exits_2(log)
def main(argv=None) -> int:
    cfg = parse_args(argv)
    return decode_codes(cfg) if isinstance(cfg, DecodeSettings) else encode_store(cfg)


if __name__ == "__main__":
    run(main, "encode", resumes=True)
