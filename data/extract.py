"""Audio -> SeamlessM4T features, written as a fairseq dump (the format data/stores.py reads).

    python -m data.extract MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --feature fbank
    python -m data.extract MANIFEST_OR_DIR SPLIT NSHARD RANK OUT_DIR --feature w2v-bert \\
        --checkpoint /models/w2v-bert-2.0 --layer 17

The input is a fairseq manifest (first line the root folder, then
`relpath<TAB>num_samples` per line) or a folder searched for .wav, .flac and
.ogg files. Rank RANK of NSHARD takes its contiguous share of the files, as in
fairseq's examples/hubert/simple_kmeans. Audio is read with soundfile, averaged
to mono and resampled to 16 kHz with soxr.

Features, both at 50 frames per second:
- `fbank`: the Seamless front-end, transformers' SeamlessM4TFeatureExtractor
  (80 log-mel bins, normalised per utterance and mel bin, stride-2 stacked to 160-d);
- `w2v-bert`: the hidden state after layer L of a Wav2Vec2BertModel
  (w2v-BERT 2.0: 1024-d, 24 layers; layer 0 is the feature projection) loaded
  from a local folder. Files longer than --max_chunk_seconds go through the
  encoder in equal chunks of at most that length, and the chunks' outputs are
  concatenated (no context crosses a chunk boundary).

Written into OUT_DIR, each under a temporary name and renamed when complete:
- `{split}_{rank}_{nshard}.npy`: float32 [frames, dim], every utterance's frames in order;
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
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, BadInputError

log = logging.getLogger("extract")

SAMPLE_RATE = 16_000
FRAME_RATE = 50  # features per second: 10 ms fbank hop, stacked by 2
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
MIN_SAMPLES = 400 + 160  # two 25 ms fbank windows: the fewest samples that give one stacked frame
FEATURES = ("fbank", "w2v-bert")


class BadAudio(Exception):
    """This file cannot be extracted; the message is the reason shown in the skipped list."""


# ---------------------------------------------------------------- inputs


def read_manifest(path: Path) -> tuple[Path, list[str]]:
    """(root, relpaths) of a fairseq manifest: the root folder, then `relpath<TAB>num_samples` lines."""
    lines = [line.rstrip("\n") for line in path.read_text().splitlines()]
    if not lines or not lines[0].strip():
        raise BadInputError(f"manifest {path} is empty: its first line must be the root folder of the audio, "
                            "then one `relpath<TAB>num_samples` line per file")
    root = Path(lines[0].strip())
    if not root.is_absolute():
        root = path.parent / root
    entries = [line.split("\t")[0] for line in lines[1:] if line.strip()]
    if not entries:
        raise BadInputError(f"manifest {path} lists no files (only the root line {lines[0]!r})")
    if not root.is_dir():
        raise BadInputError(f"manifest {path}: its root folder {root} (first line) does not exist")
    return root, entries


def list_audio_folder(folder: Path) -> list[str]:
    found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)
    if not found:
        raise BadInputError(f"no audio files ({', '.join(AUDIO_SUFFIXES)}) found under {folder}")
    return found


def audio_files(source: Path) -> tuple[Path, list[str]]:
    if not source.exists():
        raise BadInputError(f"{source} does not exist: give a fairseq manifest (.tsv) or a folder of audio files")
    if source.is_dir():
        return source.resolve(), list_audio_folder(source)
    return read_manifest(source)


def shard_range(total: int, nshard: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of `total` items, as fairseq's simple_kmeans splits a manifest."""
    return round(total / nshard * rank), round(total / nshard * (rank + 1))


def wav_truncation(path: Path) -> str | None:
    """Why a RIFF/WAVE file is cut short, or None. libsndfile reads such a file without complaint."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        size = os.fstat(f.fileno()).st_size
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                return None  # no data chunk: libsndfile refuses the file itself
            name, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if name == b"data":
                available = size - f.tell()
                # 0 and 0xFFFFFFFF are the placeholders of writers that never went back to fill in the size
                if 0 < length < 0xFFFFFFFF and length > available:
                    return f"truncated: the header declares {length} bytes of audio, the file holds {available}"
                return None
            f.seek(length + (length & 1), os.SEEK_CUR)


def load_audio(path: Path) -> np.ndarray:
    """Mono float32 samples at 16 kHz; BadAudio when the file cannot serve."""
    import soundfile as sf
    import soxr

    if not path.is_file():
        raise BadAudio("missing: no such file")
    if path.stat().st_size == 0:
        raise BadAudio("empty file (0 bytes)")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is skipped and named
        raise BadAudio(f"unreadable: {e}") from None
    if data.shape[0] == 0:
        raise BadAudio("empty: no samples")
    if path.suffix.lower() == ".wav" and (cut := wav_truncation(path)):
        raise BadAudio(cut)
    wave = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if rate != SAMPLE_RATE:
        wave = soxr.resample(wave, rate, SAMPLE_RATE).astype(np.float32, copy=False)
    if not np.isfinite(wave).all():
        raise BadAudio("malformed: NaN or Inf samples")
    if len(wave) < MIN_SAMPLES:
        raise BadAudio(f"too short: {len(wave)} samples at 16 kHz, at least {MIN_SAMPLES} give one frame")
    return np.ascontiguousarray(wave)


# ---------------------------------------------------------------- features


class SeamlessFbank:
    """The Seamless front-end: [samples] at 16 kHz -> [frames, 160], exactly the valid frames."""

    def __init__(self, preprocessor_dir: Path | None = None):
        from transformers import SeamlessM4TFeatureExtractor

        if preprocessor_dir is not None and (preprocessor_dir / "preprocessor_config.json").is_file():
            self.extractor = SeamlessM4TFeatureExtractor.from_pretrained(str(preprocessor_dir), local_files_only=True)
        else:
            self.extractor = SeamlessM4TFeatureExtractor()
        self.dim = self.extractor.feature_size * self.extractor.stride

    def __call__(self, wave: np.ndarray) -> np.ndarray:
        out = self.extractor(wave, sampling_rate=SAMPLE_RATE, return_tensors="np")
        # The extractor pads to an even number of 10 ms frames before stacking pairs; the mask drops the pad.
        valid = int(out["attention_mask"][0].sum())
        return np.asarray(out["input_features"][0, :valid], dtype=np.float32)


class W2vBertLayer:
    """Hidden state after layer `layer` of a local Wav2Vec2BertModel, fed the Seamless fbank."""

    def __init__(self, checkpoint: Path, layer: int, device: str, precision: str, max_chunk_seconds: float,
                 batch_size: int):
        import torch
        from transformers import Wav2Vec2BertModel

        config_path = checkpoint / "config.json"
        if not config_path.is_file():
            raise BadInputError(f"--checkpoint {checkpoint} has no config.json: give the folder of a "
                                "Wav2Vec2BertModel saved with save_pretrained (e.g. facebook/w2v-bert-2.0)")
        model_type = json.loads(config_path.read_text()).get("model_type")
        if model_type != "wav2vec2-bert":
            raise BadInputError(f"--checkpoint {checkpoint} holds a '{model_type}' model, not 'wav2vec2-bert' "
                                "(w2v-BERT 2.0)")
        try:
            model, info = Wav2Vec2BertModel.from_pretrained(str(checkpoint), local_files_only=True,
                                                            output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - a broken checkpoint folder is the user's to fix
            raise BadInputError(f"--checkpoint {checkpoint} could not be loaded: {e}") from None
        missing = [k for k in info.get("missing_keys", []) if "masked_spec_embed" not in k]
        if missing:
            raise BadInputError(f"--checkpoint {checkpoint} lacks weights ({', '.join(sorted(missing)[:5])}...): "
                                "the encoder would be random")
        layers = model.config.num_hidden_layers
        if not 0 <= layer <= layers:
            raise BadInputError(f"--layer {layer} is out of range: this model has layers 0 (feature projection) "
                                f"to {layers}")
        # Layers above L, the adapter and the final FFN never reach hidden_states[L]: drop them, not run them.
        model.encoder.layers = model.encoder.layers[:layer]
        model.adapter, model.intermediate_ffn = None, None
        self.device = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        self.model = model.to(self.device, self.dtype).eval()
        self.layer = layer
        self.dim = model.config.hidden_size
        self.max_chunk = max(1, int(max_chunk_seconds * FRAME_RATE))
        self.batch_size = batch_size

    def chunks(self, fbank: np.ndarray) -> list[np.ndarray]:
        """Equal chunks of at most max_chunk frames (equal, so that no last chunk is left with little context)."""
        return np.array_split(fbank, math.ceil(len(fbank) / self.max_chunk))

    def __call__(self, fbanks: list[np.ndarray]) -> list[np.ndarray]:
        import torch

        pieces = [(i, c) for i, f in enumerate(fbanks) for c in self.chunks(f)]
        outputs = [None] * len(pieces)
        order = sorted(range(len(pieces)), key=lambda k: len(pieces[k][1]))  # similar lengths, less padding
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            longest = max(len(pieces[k][1]) for k in batch)
            x = torch.zeros(len(batch), longest, pieces[batch[0]][1].shape[1])
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, k in enumerate(batch):
                n = len(pieces[k][1])
                x[row, :n] = torch.from_numpy(pieces[k][1])
                mask[row, :n] = 1
            with torch.inference_mode():
                out = self.model(input_features=x.to(self.device, self.dtype), attention_mask=mask.to(self.device),
                                 output_hidden_states=True)
            hidden = out.hidden_states[self.layer].float().cpu().numpy()
            for row, k in enumerate(batch):
                outputs[k] = hidden[row, : len(pieces[k][1])]
        per_file = [[] for _ in fbanks]
        for (i, _), out in zip(pieces, outputs, strict=True):
            per_file[i].append(out)
        return [np.concatenate(parts).astype(np.float32, copy=False) for parts in per_file]


# ---------------------------------------------------------------- outputs


def npy_header(rows: int, dim: int, size: int = 128) -> bytes:
    """A .npy v1.0 header for float32 [rows, dim], padded to `size` bytes so it can be rewritten in place."""
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (rows, dim)
    pad = size - 10 - len(text) - 1
    if pad < 0:
        raise ValueError(f"shape ({rows}, {dim}) does not fit a {size}-byte header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", size - 10) + text.encode("latin1") + b" " * pad + b"\n"


class NpyRowWriter:
    """Rows streamed into a .npy under a temporary name: the row count is written into the header at the end."""

    def __init__(self, path: Path, dim: int):
        self.path, self.dim, self.rows = path, dim, 0
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.file.write(npy_header(0, dim))

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype="<f4")
        assert rows.ndim == 2 and rows.shape[1] == self.dim, rows.shape
        self.file.write(rows.tobytes())
        self.rows += rows.shape[0]

    def finish(self) -> Path:
        """Close the temporary file with its final header; returns it (the caller renames it)."""
        self.file.seek(0)
        self.file.write(npy_header(self.rows, self.dim))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.tmp

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


def write_temporary(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def publish(pairs: list[tuple[Path, Path]], array: tuple[Path, Path]) -> None:
    """Rename temporaries into place; the .npy goes last, so a .npy on disk always has its .len beside it."""
    array[1].unlink(missing_ok=True)  # never leave an older .npy beside the new .len
    for tmp, final in [*pairs, array]:
        os.replace(tmp, final)
    dir_fd = os.open(array[1].parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# ---------------------------------------------------------------- the step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m data.extract",
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
    p.add_argument("--device", default="auto", help="w2v-bert: auto (cuda if available), cpu, cuda, cuda:1 ...")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="w2v-bert: auto is bf16 on CUDA, fp32 on CPU")
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
        encoder = W2vBertLayer(args.checkpoint, args.layer, args.device, args.precision, args.max_chunk_seconds,
                               args.batch_size)
        dim, group = encoder.dim, args.batch_size
        log.info("w2v-bert layer %d of %s on %s (%s), %d-d", args.layer, args.checkpoint, encoder.device,
                 encoder.dtype, dim)
    else:
        encoder, dim, group = None, fbank.dim, 16
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{args.split}_{args.rank}_{args.nshard}"
    log.info("%s: files %d-%d of %d from %s -> %s/%s.npy (%s, %d-d)", name, start, end - 1, len(entries),
             args.source, args.out_dir, name, args.feature, dim)

    writer = NpyRowWriter(args.out_dir / f"{name}.npy", dim)
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
                    if not np.isfinite(f).all():
                        skipped.append((rel, "malformed: the features have NaN or Inf values"))
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
                "utterances": len(kept), "frames": int(sum(lengths)), "skipped": len(skipped)}
        if encoder is not None:
            meta.update(checkpoint=str(args.checkpoint.resolve()), layer=args.layer,
                        max_chunk_seconds=args.max_chunk_seconds, precision=str(encoder.dtype).replace("torch.", ""))
        texts = {
            ".len": "".join(f"{n}\n" for n in lengths),
            ".tsv": f"{root}\n" + "".join(f"{rel}\t{samples}\n" for rel, samples in kept),
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


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return extract(args)
    except BadInputError as e:
        log.error("%s", e)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [extract] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    sys.exit(main())
