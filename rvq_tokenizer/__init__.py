"""Audio in memory to RVQ codes and back, from Python: the codes tools.tokenize writes, bit for bit.

    import rvq_tokenizer                                # the repo root on PYTHONPATH
    tokenizer = rvq_tokenizer.load("runs/mine")         # a run, one of its checkpoint files, or a tools.export folder
    codes = tokenizer.encode(wave, sample_rate)         # [code frames, levels] int16; a list of waves: a list
    features = tokenizer.decode(codes)                  # [frames, dim] float32: the codec's reconstruction

`load` reads the codec and what makes the features it was trained on, once: the fbank front-end, or w2v-BERT
from the folder its checkpoint records (or `w2v_bert=`), at the recorded layer, chunk length and precision. Then:

- `encode(audio, sample_rate)`: one waveform or a list of them -> the codes of each, [code frames, levels] in the
  dtype a code shard stores. A waveform is a numpy array or a torch tensor, [samples] or multi-channel
  ([channels, samples] or [samples, channels]: the shorter axis holds the channels, which are averaged), of float
  samples in [-1, 1] or integer PCM (int16, int32: scaled as soundfile reads such a file), at any rate (resampled
  to 16 kHz as tools.extract resamples a file); `sample_rate` is one rate, or one per waveform;
- `encode_files(paths)`: the same for audio files, read by decoding worker processes as tools.tokenize reads them;
- `features(audio, sample_rate)`: the features tools.extract writes for that audio with the codec's settings;
- `decode(codes, frames=None)`: codes (all the codec's levels or its first few; -1 adds nothing) -> features, as
  `python -m tools.encode decode` writes them: cut to an utterance's `frames` when given;
- `info`: the codec and its codes (CodecInfo), as code shards record them.

**The same bits as the tools.** The audio goes through tools.tokenize's own pipeline (rvq_tokenizer/audio_codec.py
AudioCodec, data/audio/pipeline.py FeatureWindows) with its default flags: a list is cut into windows as a shard's
files are (--commit_files files or --commit_seconds of audio at most), a window's w2v-BERT chunks into the same
forward passes (--batch_seconds) with the same attention kernel (on a CPU the folded one; on a GPU the fastest that
agrees, measured once and cached, rvq_tokenizer/pipeline_settings.py shard_attention), and its features into the
codec's passes. So
`encode(waves)` gives exactly the codes tools.tokenize writes for files holding those waves, listed in that order,
and `encode(wave)` those of a shard of that one file. w2v-BERT's last bits depend on the chunks a pass holds, so a
wave encoded alone and in a list may differ in a near tie; on a CPU the codec's own passes do not change the codes.

**Bad input** raises one ValueError that names the input and what is accepted: before any work, an empty array, one
shorter than one frame (35 ms), NaN or Inf samples, a dtype that is neither float nor int16/int32 PCM, a sample
rate that is not a positive number, a path that is no file, codes of a dtype, level or value the codec lacks; as it
is decoded, a file that cannot be read (with the reason). Nothing is written anywhere. A tokenizer holds no state
between calls: several threads may call one at once.

**The library under the commands.** This package's modules are what this API and the commands (tools.tokenize,
tools.encode, tools.evaluate, tools.extract, tools.export) share: a codec read from a run, a checkpoint or an export
(codec_files.py), the codes asked of it (codes_spec.py), the features it was trained on and what computes them
(trained_features.py), the input pipeline and what a shard records of it (pipeline_settings.py), the codec over
audio (audio_codec.py), a codec over a feature store (feature_check.py), and a shard of codes (code_shard.py). They
import no command; `import rvq_tokenizer` itself imports none of them.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rvq_tokenizer.tokenizer import RVQTokenizer

__all__ = ["load", "RVQTokenizer", "CodecInfo"]
# what `import rvq_tokenizer` does: nothing to the caller's process (no variable set, no library that sets one: the
# codec's library is imported by load), so that a notebook or a data loader may import it anywhere


def load(source: str | os.PathLike, *, device: str = "auto", precision: str | None = None,
         w2v_bert: str | os.PathLike | None = None) -> RVQTokenizer:
    """The tokenizer of a trained codec: `source` is a run's folder (the trainer's --output_dir: its newest
    checkpoint, once the run has ended), one of its checkpoint files, or a folder `python -m tools.export` wrote.
    device: auto (a GPU where there is one), cpu, cuda, cuda:1 ... precision: w2v-BERT's, which must be the
    codec's (fp32 or bf16; None: the codec's). w2v_bert: the w2v-BERT folder, where it is not where the codec
    recorded it (its files must be the same model). ValueError for a source, device or setting that cannot serve."""
    from rvq_tokenizer.tokenizer import open_tokenizer

    return open_tokenizer(source, device=device, precision=precision, w2v_bert=w2v_bert)


def __getattr__(name: str):
    """RVQTokenizer and CodecInfo, from their module once asked for (it imports the codec's libraries)."""
    if name in ("RVQTokenizer", "CodecInfo"):
        from rvq_tokenizer import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module 'rvq_tokenizer' has no attribute {name!r}")
