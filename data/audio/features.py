"""Audio -> SeamlessM4T features: reading a file into 16 kHz mono, the Seamless fbank, a w2v-BERT layer.

Audio is read with soundfile, averaged to mono and resampled to 16 kHz with soxr.
Features, both at 50 frames per second:
- `fbank`: the Seamless front-end, transformers' SeamlessM4TFeatureExtractor's fbank (80 log-mel bins,
  normalised per utterance and mel bin, stride-2 stacked to 160-d), computed in torch (data/audio/fbank.py) or by
  the extractor itself;
- `w2v-bert`: the hidden state after layer L of a Wav2Vec2BertModel
  (w2v-BERT 2.0: 1024-d, 24 layers; layer 0 is the feature projection) loaded
  from a local folder. Inputs longer than the chunk length go through the
  encoder in equal chunks of at most that length, and the chunks' outputs are
  concatenated (no context crosses a chunk boundary); the caller says which
  chunks share a forward pass.

soundfile, soxr and transformers (requirements-extract.txt) are imported where
they are used, so that importing this module needs none of them.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from data.audio.fbank import FRAME_LENGTH, HOP_LENGTH, NUM_MEL_BINS, SAMPLE_RATE, STRIDE, TorchFbank
from data.audio.w2v_graphs import Capture, GraphedPasses, padded_frames
from data.row_gather import packed_rows, padded_index, valid_positions
from data.transfers import to_device
from errors import COMMAND_LINE, Asker, BadInputError

log = logging.getLogger(__name__)

FRAME_RATE = SAMPLE_RATE // (HOP_LENGTH * STRIDE)  # features per second: 10 ms fbank hop, stacked by 2
MIN_SAMPLES = FRAME_LENGTH + HOP_LENGTH  # two 25 ms fbank windows: the fewest samples that give one stacked frame
FEATURES = ("fbank", "w2v-bert")
FRONT_ENDS = ("torch", "transformers")  # the fbank's: data/audio/fbank.py, or transformers' SeamlessM4TFeatureExtractor
FRONT_END = "torch"  # the front-end of new dumps


class BadAudio(Exception):
    """This file cannot be extracted; the message is the reason shown in the skipped list."""


def wav_truncation(f: BinaryIO) -> str | None:
    """Why a RIFF/WAVE file (a seekable binary file, read from its start) is cut short, or None. libsndfile reads
    such a file without complaint."""
    f.seek(0)
    head = f.read(12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    size = f.seek(0, os.SEEK_END)
    f.seek(12)
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
    """Mono float32 samples at 16 kHz of an audio file; BadAudio when the file cannot serve."""
    if not path.is_file():
        raise BadAudio("missing: no such file")
    with open(path, "rb") as f:
        return read_audio(f, path.suffix)


def read_audio(f: BinaryIO, suffix: str) -> np.ndarray:
    """Mono float32 samples at 16 kHz of the audio file `f` holds (a file, or an archive's member as bytes), named
    `suffix` (.wav: checked for truncation); BadAudio when it cannot serve."""
    import soundfile as sf

    if f.seek(0, os.SEEK_END) == 0:
        raise BadAudio("empty file (0 bytes)")
    f.seek(0)
    try:
        data, rate = sf.read(f, dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is skipped and named
        # libsndfile's own words: the message itself names the file object, a different one in each run
        raise BadAudio(f"unreadable: {getattr(e, 'error_string', None) or e}") from None
    if data.shape[0] == 0:
        raise BadAudio("empty: no samples")
    if suffix.lower() == ".wav" and (cut := wav_truncation(f)):
        raise BadAudio(cut)
    return model_input(data, rate)


def model_input(data: np.ndarray, rate: int) -> np.ndarray:
    """[samples, channels] float32 at `rate` -> mono float32 samples at 16 kHz (the channels averaged, soxr's
    resampling); BadAudio when they are not finite or too short for a frame."""
    import soxr

    wave = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if rate != SAMPLE_RATE:
        wave = soxr.resample(wave, rate, SAMPLE_RATE).astype(np.float32, copy=False)
    if not np.isfinite(wave).all():
        raise BadAudio("malformed: NaN or Inf samples")
    if len(wave) < MIN_SAMPLES:
        raise BadAudio(f"too short: {len(wave)} samples at 16 kHz, at least {MIN_SAMPLES} give one frame")
    return np.ascontiguousarray(wave)


class SeamlessFbank:
    """The Seamless front-end: [samples] at 16 kHz -> [frames, 160], exactly the valid frames.

    `front_end`: "torch" (data/audio/fbank.py: the same fbank computed in torch, equal to the extractor's within
    1e-4) or "transformers" (transformers' SeamlessM4TFeatureExtractor itself, what every dump was made with before
    the front-end was recorded). A model folder's preprocessor_config.json, when there is one, configures the
    extractor; the torch front-end computes the extractor's defaults (those of w2v-BERT 2.0's preprocessor) and
    refuses a folder whose preprocessor asks for another fbank. Called on a thread other than the main one (the
    decoding of `--num_workers 0`), the torch front-end runs that thread's torch ops on one core, as a DataLoader
    worker's (and torch's pin-memory thread) do: the decoders are the parallelism, and a second team of threads
    beside the model's waits on busy cores."""

    def __init__(self, preprocessor_dir: Path | None = None, front_end: str = FRONT_END):
        if front_end not in FRONT_ENDS:
            raise ValueError(f"front_end must be one of {FRONT_ENDS}, not {front_end!r}")
        self.front_end = front_end
        config = preprocessor_dir / "preprocessor_config.json" if preprocessor_dir is not None else None
        if front_end == "torch":
            if config is not None and config.is_file():
                check_torch_preprocessor(config)
            self.torch_fbank = TorchFbank(torch.device("cpu"))
            self.dim = self.torch_fbank.dim
            return
        from transformers import SeamlessM4TFeatureExtractor

        if config is not None and config.is_file():
            self.extractor = SeamlessM4TFeatureExtractor.from_pretrained(str(preprocessor_dir), local_files_only=True)
        else:
            self.extractor = SeamlessM4TFeatureExtractor()
        self.dim = self.extractor.feature_size * self.extractor.stride

    def __call__(self, wave: np.ndarray) -> np.ndarray:
        if self.front_end == "torch":
            if threading.current_thread() is not threading.main_thread() and torch.get_num_threads() != 1:
                torch.set_num_threads(1)
            return self.torch_fbank(wave).numpy()
        out = self.extractor(wave, sampling_rate=SAMPLE_RATE, return_tensors="np")
        # The extractor pads to an even number of 10 ms frames before stacking pairs; the mask drops the pad.
        valid = int(out["attention_mask"][0].sum())
        return np.asarray(out["input_features"][0, :valid], dtype=np.float32)


def check_torch_preprocessor(config: Path) -> None:
    """BadInputError when a preprocessor_config.json asks for an fbank other than the one the torch front-end
    computes (SeamlessM4TFeatureExtractor's defaults)."""
    try:
        given = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise BadInputError(f"{config} cannot be read: {e}") from None
    wanted = {"feature_extractor_type": "SeamlessM4TFeatureExtractor", "feature_size": NUM_MEL_BINS,
              "num_mel_bins": NUM_MEL_BINS, "sampling_rate": SAMPLE_RATE, "stride": STRIDE}
    other = {k: given[k] for k, v in wanted.items() if k in given and given[k] != v}
    if other:
        raise BadInputError(f"{config} asks for another fbank than the torch front-end computes "
                            f"({', '.join(f'{k}: {v!r}' for k, v in other.items())}; it computes {wanted}): "
                            "use the transformers front-end (--front_end transformers)")


class W2vBertLayer:
    """Hidden state after layer `layer` of a local Wav2Vec2BertModel, fed the Seamless fbank.

    `device` and `dtype` are the caller's choice (training/device.py resolves the flags); `flag` names the
    model's folder in messages, in the `asker`'s words (tools.extract's --checkpoint, tools.tokenize's --w2v_bert,
    rvq_tokenizer's w2v_bert=). `attention`: "fast"
    puts data/audio/w2v_attention.py's relative-position attention (no T x T table, same outputs) in place of
    transformers' one; "stock" keeps transformers' module (for comparison). `compile`: the truncated encoder
    under torch.compile with dynamic shapes (a pass's rows and length are symbolic, so a new pass shape reuses
    the graph); each graph compiled is counted and logged (`graphs`). `graphs`: graph mode
    (data/audio/w2v_graphs.py), each pass's chunks padded to a multiple of GRAPH_FRAMES and replayed from a CUDA
    graph of its shape (`graph_capture`: another way to capture, for a test)."""

    def __init__(self, checkpoint: Path, layer: int, *, device: torch.device, dtype: torch.dtype,
                 max_chunk_seconds: float, flag: str = "checkpoint", asker: Asker = COMMAND_LINE,
                 attention: str = "fast", compile: bool = False, graphs: bool = False, graph_capture: Capture | None = None):
        from transformers import Wav2Vec2BertModel

        if attention not in ("fast", "stock"):
            raise ValueError(f"attention must be 'fast' or 'stock', not {attention!r}")
        if compile and device.type == "cuda":
            raise BadInputError("--compile on is refused on a GPU: its compile with dynamic shapes failed on an H100 "
                                "and did not finish in 200 s on an H200 (benchmarks/README.md); --graphs on takes the "
                                "launches off the host instead")

        config_path = checkpoint / "config.json"
        if not config_path.is_file():
            raise BadInputError(f"{asker.option(flag, checkpoint)} has no config.json: give the folder of a "
                                "Wav2Vec2BertModel saved with save_pretrained (e.g. facebook/w2v-bert-2.0)")
        model_type = json.loads(config_path.read_text()).get("model_type")
        if model_type != "wav2vec2-bert":
            raise BadInputError(f"{asker.option(flag, checkpoint)} holds a '{model_type}' model, not 'wav2vec2-bert' "
                                "(w2v-BERT 2.0)")
        try:
            model, info = Wav2Vec2BertModel.from_pretrained(str(checkpoint), local_files_only=True,
                                                            output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - a broken checkpoint folder is the user's to fix
            raise BadInputError(f"{asker.option(flag, checkpoint)} could not be loaded: {e}") from None
        missing = [k for k in info.get("missing_keys", []) if "masked_spec_embed" not in k]
        if missing:
            raise BadInputError(f"{asker.option(flag, checkpoint)} lacks weights "
                                f"({', '.join(sorted(missing)[:5])}...): the encoder would be random")
        layers = model.config.num_hidden_layers
        if not 0 <= layer <= layers:
            raise BadInputError(f"--layer {layer} is out of range: this model has layers 0 (feature projection) "
                                f"to {layers}")
        # Layers above L, the adapter and the final FFN never reach hidden_states[L]: drop them, not run them.
        model.encoder.layers = model.encoder.layers[:layer]
        model.adapter, model.intermediate_ffn = None, None
        if attention == "fast":
            from data.audio.w2v_attention import use_fast_attention
            use_fast_attention(model)
        self.device, self.dtype = device, dtype
        self.model = model.to(device, dtype).eval()
        self.compiled, self.graphs = compile, 0
        if compile:
            self.model = torch.compile(self.model, dynamic=True)
        self.graphed = None  # graph mode: GraphedPasses
        if graphs:
            if compile or attention != "fast":
                raise ValueError("graph mode runs our attention, eager: not with compile or transformers' module")
            if device.type != "cuda" and graph_capture is None:
                raise BadInputError(f"--graphs on records a pass as a CUDA graph: it needs a GPU, not {device}")
            self.graphed = GraphedPasses(self._layer_output, graph_capture)
        self.layer = layer
        self.dim = model.config.hidden_size
        from data.audio.w2v_attention import RelativeKeySelfAttention
        self.attentions = [m for m in self.model.modules() if isinstance(m, RelativeKeySelfAttention)]
        self.max_chunk = max(1, int(max_chunk_seconds * FRAME_RATE))

    @property
    def attention(self) -> str:
        """The relative-position attention's kernel (data/audio/w2v_attention.py KERNELS), or "stock" where
        transformers' module was kept."""
        return self.attentions[0].kernel if self.attentions else "stock"

    def use_attention(self, kernel: str) -> None:
        """Every layer's attention computes with `kernel` (data/audio/attention_choice.py chooses it)."""
        if not self.attentions:
            raise ValueError("this model keeps transformers' attention: it has no kernel to choose")
        for attention in self.attentions:
            attention.kernel = kernel

    def chunks(self, fbank: np.ndarray | torch.Tensor) -> list[np.ndarray] | list[torch.Tensor]:
        """Equal chunks of at most max_chunk frames (equal, so that no last chunk is left with little context): views
        of an array, or of a tensor where it lies, of chunk_sizes' lengths."""
        sizes = chunk_sizes(len(fbank), self.max_chunk)
        return [fbank[end - size : end] for size, end in zip(sizes, np.cumsum(sizes))]

    def hidden(self, chunks: list[np.ndarray] | list[torch.Tensor]) -> torch.Tensor:
        """[T_i, 160] fbank chunks (arrays, or tensors on the host or on the device) -> the layer's [rows, longest,
        dim] output on the device, in the model's dtype, from one forward pass (each row zero-padded to the longest,
        its padding masked)."""
        lengths = np.array([len(c) for c in chunks], dtype=np.int64)
        packed = packed_rows(chunks)
        hidden = self._pass(packed, np.cumsum([0, *lengths[:-1]]), lengths)
        return hidden if self.graphed is None else hidden.clone()  # a graph's buffer is its next replay's

    def _pass(self, packed: np.ndarray | torch.Tensor, firsts: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """One forward pass over the chunks packed[firsts[i] : firsts[i] + lengths[i]] of `packed` (packed_rows: the
        chunks' rows one after another, then a row of zeros), as hidden returns it. The padded input is one gather
        of `packed`, its index made on the host, so a pass dispatches the same few ops whatever its rows: nothing
        waits for the device, and an index made on the host reaches a GPU from pinned memory (data/transfers.py
        to_device). A pass with no padding has no mask where our attention runs (an all-ones mask computes the
        same, after transformers reads it back from the device to find out)."""
        longest = int(lengths.max()) if self.graphed is None else padded_frames(int(lengths.max()))
        valid = np.arange(longest) < lengths[:, None]
        index = padded_index(firsts, lengths, longest, len(packed) - 1)
        if isinstance(packed, torch.Tensor):
            x = packed.index_select(0, to_device(index, packed.device))
        else:
            x = torch.from_numpy(packed[index])
        x = x.view(len(lengths), longest, packed.shape[1])
        padded = self.compiled or self.graphed is not None or not self.attentions or not valid.all()
        mask = torch.from_numpy(valid.astype(np.int64)) if padded else None
        if self.graphed is not None:  # a graph holds the pass as captured: always a mask
            return self.graphed(to_device(x, self.device).to(self.dtype), to_device(mask, self.device))
        graphs = compiled_graphs() if self.compiled else 0
        began = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_features=to_device(x, self.device).to(self.dtype),
                             attention_mask=None if mask is None else to_device(mask, self.device),
                             output_hidden_states=True)
        if self.compiled and compiled_graphs() > graphs:
            self.graphs += compiled_graphs() - graphs
            log.info("w2v-bert: compiled graph %d, for a pass of %d x %d frames (%.1f s)", self.graphs, len(lengths),
                     longest, time.perf_counter() - began)
        return out.hidden_states[self.layer]

    def _layer_output(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The layer's output of one pass of padded input `x` and its `mask` (graph mode's pass, as captured)."""
        return self.model(input_features=x, attention_mask=mask, output_hidden_states=True).hidden_states[self.layer]

    def forward(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        """[T_i, 160] fbank chunks -> their [T_i, dim] float32 layer outputs on the host, in one forward pass."""
        hidden = self.hidden(chunks).float().cpu().numpy()
        return [hidden[row, : len(chunk)] for row, chunk in enumerate(chunks)]

    def encode(self, fbanks: list[np.ndarray] | list[torch.Tensor], passes: Callable[[np.ndarray], list[np.ndarray]],
               on_batch: Callable[[float], None] | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Layer outputs of whole files, packed on the device: [the files' frames in all, dim] in `dtype`, file i's
        rows after file i - 1's. Every chunk of `fbanks` (arrays from the decoding workers, or tensors the device
        computed) is grouped into forward passes by `passes` (chunk lengths in frames -> the positions of each
        pass: the tools give data/audio/pass_plan.py's least-cost cut of the sorted chunks under --batch_seconds), and
        each pass's output is cast into its rows as soon as it is computed, in one gather and one scatter whatever
        its rows: no copy to the host, no wait for the device, one pass's output alive at a time. on_batch(files)
        after each pass: the share of the files it did (a chunk of a file in k chunks counts 1/k), for a caller's
        progress bar."""
        firsts, lengths, shares = [], [], []  # each chunk's first row in the files' rows, its length, its share
        rows = 0
        for fbank in fbanks:
            sizes = chunk_sizes(len(fbank), self.max_chunk)
            firsts += (rows + np.cumsum([0, *sizes[:-1]])).tolist()
            lengths += sizes
            shares += [1 / len(sizes)] * len(sizes)
            rows += len(fbank)
        firsts, lengths = np.array(firsts, dtype=np.int64), np.array(lengths, dtype=np.int64)
        with torch.inference_mode():
            packed = packed_rows(fbanks)
            out = torch.empty(rows, self.dim, dtype=dtype, device=self.device)
            for batch in passes(lengths):
                hidden = self._pass(packed, firsts[batch], lengths[batch])
                source, target = valid_positions(firsts[batch], lengths[batch], hidden.shape[1])
                out.index_copy_(0, to_device(target, self.device),
                                hidden.reshape(-1, self.dim).index_select(0, to_device(source, self.device)).to(dtype))
                if on_batch is not None:
                    on_batch(sum(shares[k] for k in batch))
        return out

    def __call__(self, fbanks: list[np.ndarray], passes: Callable[[np.ndarray], list[np.ndarray]],
                 on_batch: Callable[[float], None] | None = None) -> list[np.ndarray]:
        """encode's layer outputs as one float32 [frames, dim] array per file, on the host."""
        out = self.encode(fbanks, passes, on_batch).cpu().numpy()
        return np.split(out, np.cumsum([len(f) for f in fbanks])[:-1])


def chunk_sizes(frames: int, max_chunk: int) -> list[int]:
    """The lengths of a file's chunks (W2vBertLayer.chunks): as few as hold at most max_chunk frames each, as equal
    as can be, the longer first (as np.array_split cuts)."""
    parts = math.ceil(frames / max_chunk)
    return [frames // parts + 1] * (frames % parts) + [frames // parts] * (parts - frames % parts)


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
