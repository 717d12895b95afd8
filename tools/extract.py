"""Audio -> SeamlessM4T features, written as a fairseq dump (the format data/stores.py reads).

    python -m tools.extract MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --feature fbank
    python -m tools.extract MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --feature w2v-bert \\
        --checkpoint /models/w2v-bert-2.0 --layer 17

The input is a fairseq manifest (first line the root folder, then
`relpath<TAB>num_samples` per line) or a folder searched for .wav, .flac and
.ogg files (data/audio_manifest.py). Rank RANK of NSHARD takes its contiguous
share of the files, as in fairseq's examples/hubert/simple_kmeans. The audio
and the features (`fbank`: the Seamless front-end, 160-d; `w2v-bert`: a
Wav2Vec2BertModel layer, in chunks of at most --max_chunk_seconds) are
data/audio_features.py's; --device and --precision are resolved by
training/device.py.

Written into OUT_DIR, each under a temporary name and renamed when complete:
- `{split}_{rank}_{nshard}.npy`: float32 (or --dtype float16) [frames, dim], every utterance's frames in order;
- `{split}_{rank}_{nshard}.len`: one frame count per line;
- `{split}_{rank}_{nshard}.tsv`: the files extracted, in order, as a fairseq manifest
  (root folder, then `relpath<TAB>samples at 16 kHz`), to match features and codes to files;
- `{split}_{rank}_{nshard}.skipped`: `relpath<TAB>reason` for every file that was skipped;
- `{split}_{rank}_{nshard}.json`: what was extracted (feature kind, dim, checkpoint, layer, counts).

A file that cannot be read, is empty, too short, truncated or gives non-finite
features is skipped, named and counted; the rest goes on. Exit codes: 0 done;
1 no file could be extracted (nothing written); 2 bad arguments or an empty
or missing manifest/folder.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.audio_features import FEATURES, FRAME_RATE, SAMPLE_RATE, BadAudio, SeamlessFbank, W2vBertLayer, load_audio
from data.audio_manifest import audio_files, manifest_text
from data.dump_writer import DUMP_DTYPES, NpyRowWriter, len_text, publish, shard_range, write_temporary
from errors import EXIT_FAILURE, EXIT_OK, BadInputError
from tools.cli import bad_input_exits_2, run
from training.device import compute_dtype, shard_device

log = logging.getLogger("extract")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.extract",
        description="Extract SeamlessM4T features from audio into a fairseq dump ({split}_{rank}_{nshard}.npy/.len).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("source", type=Path, help="a fairseq manifest (.tsv: root line, then relpath<TAB>num_samples) "
                                             "or a folder of .wav/.flac/.ogg files")
    p.add_argument("split", help="name of the split written, e.g. train or valid")
    p.add_argument("nshard", type=int, help="number of shards the file list is cut into")
    p.add_argument("rank", type=int, help="which shard this process extracts (0 .. nshard-1)")
    p.add_argument("out_dir", type=Path, help="folder for the dump (the trainer's --data_dir)")
    p.add_argument("--feature", choices=FEATURES, default="fbank",
                   help="fbank: Seamless front-end, 160-d; w2v-bert: a Wav2Vec2BertModel layer")
    p.add_argument("--checkpoint", type=Path, help="w2v-bert: local folder of the model (save_pretrained layout)")
    p.add_argument("--layer", type=int, help="w2v-bert: hidden state after this layer (0 = feature projection; "
                                             "w2v-BERT 2.0 has 24; MaskGCT's semantic codec uses 17)")
    p.add_argument("--device", default="auto",
                   help="w2v-bert: auto or cuda (cuda:<rank %% visible GPUs>, so that shards run side by side), cpu, cuda:1 ...")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="w2v-bert: auto is bf16 on a GPU with native bf16, else fp32")
    p.add_argument("--dtype", choices=DUMP_DTYPES, default="float32",
                   help="the dump's dtype: float16 halves disk and IO (values beyond +-65504 make a file skipped)")
    p.add_argument("--batch_size", type=int, default=8, help="w2v-bert: chunks per forward pass")
    p.add_argument("--max_chunk_seconds", type=float, default=30.0,
                   help="w2v-bert: longer files are encoded in equal chunks of at most this length")
    args = p.parse_args(None if argv is None else [str(a) for a in argv])
    if args.nshard < 1 or not 0 <= args.rank < args.nshard:
        p.error(f"need nshard >= 1 and 0 <= rank < nshard, got nshard {args.nshard}, rank {args.rank}")
    if args.feature == "w2v-bert" and (args.checkpoint is None or args.layer is None):
        p.error("--feature w2v-bert needs --checkpoint DIR (a local Wav2Vec2BertModel) and --layer L")
    if args.batch_size < 1 or args.max_chunk_seconds <= 0:
        p.error("--batch_size and --max_chunk_seconds must be positive")
    return args


def extract(args) -> int:
    root, entries = audio_files(args.source)
    start, end = shard_range(len(entries), args.nshard, args.rank)
    mine = entries[start:end]
    if not mine:
        raise BadInputError(f"shard {args.rank} of {args.nshard} is empty: {args.source} lists only "
                            f"{len(entries)} file(s); use fewer shards")
    fbank = SeamlessFbank(args.checkpoint)
    if args.feature == "w2v-bert":
        device = shard_device(args.device, args.rank)  # shards on one node spread over its GPUs
        encoder = W2vBertLayer(args.checkpoint, args.layer, device=device,
                               dtype=compute_dtype(args.precision, device) or torch.float32,
                               max_chunk_seconds=args.max_chunk_seconds, batch_size=args.batch_size)
        dim, group = encoder.dim, args.batch_size
        log.info("w2v-bert layer %d of %s on %s (%s), %d-d", args.layer, args.checkpoint, encoder.device,
                 encoder.dtype, dim)
    else:
        encoder, dim, group = None, fbank.dim, 16
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{args.split}_{args.rank}_{args.nshard}"
    log.info("%s: files %d-%d of %d from %s -> %s/%s.npy (%s, %d-d)", name, start, end - 1, len(entries),
             args.source, args.out_dir, name, args.feature, dim)

    writer = NpyRowWriter(args.out_dir / f"{name}.npy", dim, dtype=args.dtype)
    lengths, kept, skipped, pairs = [], [], [], []
    began = time.perf_counter()
    try:
        with tqdm(total=len(mine), desc=f"extract {name}", unit="file", dynamic_ncols=True, mininterval=1.0) as bar:
            for g in range(0, len(mine), group):
                batch = []  # (relpath, samples, fbank) of the files in this group that could be read
                for rel in mine[g : g + group]:
                    try:
                        wave = load_audio(root / rel)
                        batch.append((rel, len(wave), fbank(wave)))
                    except BadAudio as e:
                        skipped.append((rel, str(e)))
                feats = encoder([f for _, _, f in batch]) if encoder and batch else [f for _, _, f in batch]
                for (rel, samples, _), f in zip(batch, feats, strict=True):
                    f = np.asarray(f, dtype=args.dtype)  # checked as written: float16 overflows to Inf
                    if not np.isfinite(f).all():
                        skipped.append((rel, f"malformed: the features have NaN or Inf values (as {args.dtype})"))
                        continue
                    writer.append(f)
                    lengths.append(len(f))
                    kept.append((rel, samples))
                bar.update(len(mine[g : g + group]))
                bar.set_postfix(skipped=len(skipped))
        seconds = time.perf_counter() - began
        for rel, reason in skipped:
            log.warning("skipped %s: %s", rel, reason)
        if not kept:
            writer.discard()
            log.error("nothing written: all %d file(s) of shard %d/%d were skipped (reasons above)",
                      len(mine), args.rank, args.nshard)
            return EXIT_FAILURE
        meta = {"feature": args.feature, "dim": dim, "frame_rate_hz": FRAME_RATE, "sample_rate": SAMPLE_RATE,
                "source": str(args.source), "split": args.split, "rank": args.rank, "nshard": args.nshard,
                "utterances": len(kept), "frames": int(sum(lengths)), "skipped": len(skipped), "dtype": args.dtype,
                "precision": "float32"}
        if encoder is not None:
            meta.update(checkpoint=str(args.checkpoint.resolve()), layer=args.layer,
                        max_chunk_seconds=args.max_chunk_seconds, precision=str(encoder.dtype).replace("torch.", ""))
        texts = {
            ".len": len_text(lengths),
            ".tsv": manifest_text(root, [f"{rel}\t{samples}" for rel, samples in kept]),
            ".skipped": "".join(f"{rel}\t{reason}\n" for rel, reason in skipped),
            ".json": json.dumps(meta, indent=1) + "\n",
        }
        for ext, text in texts.items():
            pairs.append((write_temporary(args.out_dir / (name + ext), text), args.out_dir / (name + ext)))
        publish(pairs, (writer.finish(), writer.path))
    except BaseException:
        writer.discard()
        for tmp, _ in pairs:
            tmp.unlink(missing_ok=True)
        raise
    frames = sum(lengths)
    log.info("wrote %d utterances, %d frames (%.1f min at %d Hz) to %s in %.1f s; skipped %d file(s)%s",
             len(kept), frames, frames / FRAME_RATE / 60, FRAME_RATE, writer.path, seconds, len(skipped),
             f", listed in {name}.skipped" if skipped else "")
    log.info("finished successfully")
    return EXIT_OK


@bad_input_exits_2(log)
def main(argv=None) -> int:
    return extract(parse_args(argv))


if __name__ == "__main__":
    run(main, "extract")
