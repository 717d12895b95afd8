"""A feature store -> RVQ codes with a trained codec, and codes -> features again.

    python -m tools.encode --checkpoint RUN_DIR_OR_CKPT --data_dir FEATS --split train --output_dir CODES
    python -m tools.encode decode --checkpoint RUN_DIR_OR_CKPT --codes_dir CODES --split train --output_dir RECON

Encoding takes every utterance of the split (all its shards, in order), and
rank RANK of NSHARD encodes its contiguous share, as in fairseq's simple_kmeans.
Written into --output_dir, each under a temporary name and renamed when complete:

- `{split}_{rank}_{nshard}.codes.npy`: [code frames, levels], every utterance's codes in
  order; int16 when every code fits (codebook_size <= 32768), else int32;
- `{split}_{rank}_{nshard}.codes.len`: code frames per utterance, one per line;
- `{split}_{rank}_{nshard}.codes.json`: checkpoint, step, levels, codebook size,
  downsample, dtype, and each utterance's feature frame count (`feature_frames`);
- `{split}_{rank}_{nshard}.codes.tsv`: when the store was written by tools.extract,
  the audio files of these utterances in order (a fairseq manifest).

`--num_quantizers q` keeps the first q levels (a lower bitrate). An utterance of
T frames gives ceil(T / downsample) code frames: its tail is padded by repeating
its last frame up to a multiple of the codec's downsample. Decoding writes a
fairseq dump (`{split}_{rank}_{nshard}.npy/.len`) of the reconstructed features,
cut back to each utterance's T frames when the .codes.json gives them.

Utterances are encoded one at a time (models/codes.py), in eval mode and
float32, so an utterance's codes never depend on its neighbours; --device is
resolved by training/device.py. Exit codes: 0 done, 2 bad
arguments or data (nothing written), 1 anything else.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.audio_manifest import manifest_text, split_manifest
from data.dump_writer import NpyRowWriter, len_text, publish, shard_range, write_temporary
from data.stores import find_split
from errors import EXIT_OK, BadInputError
from models.codes import code_dtype, decode_utterance, encode_utterance
from tools.cli import bad_input_exits_2, run
from tools.trained_codec import load_codec
from training.device import select_device

log = logging.getLogger("encode")


def encode_store(args) -> int:
    model, state, ckpt_path = load_codec(args.checkpoint, select_device(args.device))
    config = model.config
    q = args.num_quantizers or config.num_quantizers
    if not 1 <= q <= config.num_quantizers:
        raise BadInputError(f"--num_quantizers {q}: this codec has levels 1 to {config.num_quantizers}")
    if not args.data_dir.is_dir():
        raise BadInputError(f"--data_dir {args.data_dir} is not a folder")
    store = find_split(args.data_dir, args.split)
    if store is None or len(store) == 0:
        raise BadInputError(f"no split '{args.split}' in {args.data_dir}: expected a fairseq dump "
                            f"({args.split}_0_1.npy with .len) or a folder {args.split}/ of .npy/.pt arrays")
    if store.dim != config.feature_dim:
        raise BadInputError(f"{store.description} has {store.dim}-d features; the codec in {ckpt_path} was "
                            f"trained on {config.feature_dim}-d")
    start, end = shard_range(len(store), args.nshard, args.rank)
    if start == end:
        raise BadInputError(f"shard {args.rank} of {args.nshard} is empty: the split has {len(store)} utterances")
    dtype = code_dtype(config.codebook_size)
    name = f"{args.split}_{args.rank}_{args.nshard}"
    log.info("%s: utterances %d-%d of %d in %s -> %s/%s.codes.npy, %d of %d levels x %d codes, downsample %d, %s",
             name, start, end - 1, len(store), store.description, args.output_dir, name, q,
             config.num_quantizers, config.codebook_size, config.downsample, dtype)

    codes, code_lengths, feature_frames = [], [], []
    for i in tqdm(range(start, end), desc=f"encode {name}", unit="utt", dynamic_ncols=True, mininterval=1.0):
        features = np.asarray(store.utterance(i))
        c = encode_utterance(model, features, q)
        codes.append(c.astype(dtype))
        code_lengths.append(len(c))
        feature_frames.append(int(features.shape[0]))

    args.output_dir.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": str(ckpt_path.resolve()), "step": state.get("step"), "levels": q,
            "codebook_size": config.codebook_size, "downsample": config.downsample, "dtype": dtype.name,
            "feature_dim": config.feature_dim, "store": store.description, "split": args.split, "rank": args.rank,
            "nshard": args.nshard, "first_utterance": start, "utterances": end - start,
            "padding": "each utterance's tail is padded by repeating its last frame to a multiple of downsample",
            "feature_frames": feature_frames}
    texts = {".codes.len": len_text(code_lengths), ".codes.json": json.dumps(meta) + "\n"}
    manifest = split_manifest(args.data_dir, args.split, len(store))
    if manifest is not None:
        root, lines = manifest
        texts[".codes.tsv"] = manifest_text(root, lines[start:end])
    pairs = [(write_temporary(args.output_dir / (name + ext), text), args.output_dir / (name + ext))
             for ext, text in texts.items()]
    array = args.output_dir / f"{name}.codes.npy"
    tmp = array.with_name(array.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.concatenate(codes) if codes else np.zeros((0, q), dtype))
    publish(pairs, (tmp, array))
    log.info("wrote %d utterances, %d code frames (%d levels, %.0f bits/frame of features) to %s",
             end - start, sum(code_lengths), q, q * math.log2(config.codebook_size) / config.downsample, array)
    log.info("finished successfully")
    return EXIT_OK


def decode_codes(args) -> int:
    model, _, ckpt_path = load_codec(args.checkpoint, select_device(args.device))
    name = f"{args.split}_{args.rank}_{args.nshard}"
    array, lens = args.codes_dir / f"{name}.codes.npy", args.codes_dir / f"{name}.codes.len"
    if not array.is_file() or not lens.is_file():
        raise BadInputError(f"{array} or {lens.name} is missing: run python -m tools.encode first")
    codes = np.load(array)
    counts = [int(n) for n in lens.read_text().split()]
    if codes.ndim != 2 or sum(counts) != codes.shape[0]:
        raise BadInputError(f"{lens.name} lists {sum(counts)} code frames but {array.name} has shape {codes.shape}")
    if not 1 <= codes.shape[1] <= model.config.num_quantizers:
        raise BadInputError(f"{array.name} has {codes.shape[1]} levels; the codec in {ckpt_path} has "
                            f"{model.config.num_quantizers}")
    meta_path = args.codes_dir / f"{name}.codes.json"
    frames = json.loads(meta_path.read_text()).get("feature_frames") if meta_path.is_file() else None
    if frames is not None and len(frames) != len(counts):
        frames = None
    args.output_dir.mkdir(parents=True, exist_ok=True)
    writer = NpyRowWriter(args.output_dir / f"{name}.npy", model.config.feature_dim)
    lengths, row = [], 0
    try:
        for i, n in enumerate(tqdm(counts, desc=f"decode {name}", unit="utt", dynamic_ncols=True, mininterval=1.0)):
            out = decode_utterance(model, codes[row : row + n], frames[i] if frames else None)
            writer.append(out)
            lengths.append(len(out))
            row += n
        len_path = args.output_dir / f"{name}.len"
        publish([(write_temporary(len_path, len_text(lengths)), len_path)],
                (writer.finish(), writer.path))
    except BaseException:
        writer.discard()
        raise
    log.info("wrote %d utterances, %d frames of %d-d features to %s", len(lengths), sum(lengths),
             model.config.feature_dim, writer.path)
    log.info("finished successfully")
    return EXIT_OK


def parse_args(argv=None) -> argparse.Namespace:
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    decoding = bool(argv) and argv[0] == "decode"
    p = argparse.ArgumentParser(
        prog="python -m tools.encode" + (" decode" if decoding else ""),
        description=("Decode RVQ codes back to features (a fairseq dump)." if decoding else
                     "Encode a feature store to RVQ codes (`decode --help`: codes -> features)."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint file, or a run's --output_dir "
                                                                  "(its newest checkpoint)")
    if decoding:
        p.add_argument("--codes_dir", type=Path, required=True, help="where tools.encode wrote the codes")
    else:
        p.add_argument("--data_dir", type=Path, required=True, help="the feature store (as the trainer's --data_dir)")
        p.add_argument("--num_quantizers", type=int, help="keep the first q levels (default: all)")
    p.add_argument("--split", default="train")
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--nshard", type=int, default=1, help="number of shards the split is cut into")
    p.add_argument("--rank", type=int, default=0, help="which shard this process handles")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    args = p.parse_args(argv[1:] if decoding else argv)
    if args.nshard < 1 or not 0 <= args.rank < args.nshard:
        p.error(f"need nshard >= 1 and 0 <= rank < nshard, got nshard {args.nshard}, rank {args.rank}")
    args.decode = decoding
    return args


@bad_input_exits_2(log)
def main(argv=None) -> int:
    args = parse_args(argv)
    return decode_codes(args) if args.decode else encode_store(args)


if __name__ == "__main__":
    run(main, "encode")
