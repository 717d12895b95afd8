"""Audio in memory to RVQ codes and back, from Python: the codes tools.tokenize writes, bit for bit.

    import rvq_tokenizer                                # the checkout on PYTHONPATH (or the folder you run in)
    tokenizer = rvq_tokenizer.load("runs/mine")         # a run, one of its checkpoint files, or a tools.export folder
    codes = tokenizer.encode(wave, sample_rate)         # [code frames, levels] int16; a list of waves: a list
    features = tokenizer.decode(codes)                  # [frames, dim] float32: the codec's reconstruction

`load` reads the codec and what makes the features it was trained on, once: the fbank front-end, or w2v-BERT
from the folder its checkpoint records (or `w2v_bert=`), at the recorded layer, chunk length and precision. Then
(each method's help() gives its arguments, results, errors and an example):

- `encode(audio, sample_rate, *, lengths=None, levels=None, kbps=None)`: the codes of one utterance, of a list of
  them, or of a batch [batch, channels, samples] with `lengths` (each utterance's samples); `levels=` keeps the
  codec's first few levels (a lower bitrate), as `tools.tokenize --num_quantizers` does, `kbps=` those that make
  that many kilobits per second, as `--kbps` does;
- `encode_files(paths)`: the same for audio files, read by decoding worker processes as tools.tokenize reads them;
- `features(audio, sample_rate)`: the features tools.extract writes for that audio with the codec's settings;
- `decode(codes, frames=None)`: codes (all the codec's levels or its first few; -1 adds nothing) -> features, as
  `python -m tools.encode decode` writes them: cut to an utterance's `frames` when given;
- `sample_rate` (16000, what every waveform is resampled to), `frame_rate` (code frames per second), `levels`,
  `kbps_per_level`, `device`, and `info` (CodecInfo: the codec and its codes, as code shards record them).

**Audio** is a numpy array or a torch tensor of float samples in [-1, 1] or integer PCM (int16, int32: scaled as
soundfile reads such a file), at any rate from 1,000 to 384,000 Hz (resampled to 16 kHz as tools.extract resamples a
file). One utterance is [samples], [samples, channels] (soundfile's layout) or [1, samples]; several are a list of
utterances (each [samples] or multi-channel: the shorter axis holds the channels) or a batch [batch, channels,
samples] with `lengths`. A multi-channel utterance's channels are averaged, as tools.extract averages a file's; two
utterances are never averaged into one: a lone 2-D array of two rows or more, [2, 32000] say, is both one
utterance of 2 channels and 2 utterances, and is refused with the two ways to say which. One utterance gives one
result, several a list; numpy in gives numpy out, a torch tensor in a torch tensor out, on the tokenizer's device.

**The same bits as the tools.** The audio goes through tools.tokenize's own pipeline (rvq_tokenizer/audio_codec.py
AudioCodec, data/audio/pipeline.py FeatureWindows) with its default flags: a list or a batch is cut into windows as a
shard's files are (--commit_files files or --commit_seconds of audio at most), a window's w2v-BERT chunks into the
same forward passes (--batch_seconds) with the same attention kernel (on a CPU the folded one; on a GPU the fastest
that agrees, measured once and cached, rvq_tokenizer/pipeline_settings.py shard_attention), and its features into
the codec's passes. So `encode(waves)` gives exactly the codes tools.tokenize writes for files holding those waves,
listed in that order, a batch with its lengths the codes of the list of its utterances, and `encode(wave)` those of
a shard of that one file. On a CPU an utterance's codes are the same bits alone and in any company (a list, its
order, a long stranger beside it): each w2v-BERT chunk is a pass of its own there, and the codec's passes change no
code. On a GPU, w2v-BERT's passes hold many chunks and bf16 products may change their last bits with a pass's
shape: a code at a near tie can then differ (benchmarks/codes_in_company.py measures how often).

**Bad input** raises one ValueError that names the argument (`audio[3]`, `sample_rate`, `levels=`, `device=`,
`source`) and what is accepted, before any work: an empty array, one shorter than one frame (35 ms), NaN or Inf
samples, a dtype that is neither float nor int16/int32 PCM, float samples of PCM's scale (a peak of 100 or more; a
peak above 2 is taken with a warning), a sample rate outside 1,000-384,000 Hz (22.05 is not 22050), a 2-D array
that could be either, a path that is no file, codes of a dtype, level or value the codec lacks; as it is decoded, a
file that cannot be read (with the reason). Nothing is written anywhere. A tokenizer holds no state between calls:
several threads may call one at once.

**Importing it** changes nothing in the caller's process (no variable set, nothing of the codec imported until
`load`). It needs this checkout's packages `errors`, `data`, `models` and `training` under those names: where
another package of one of those names stands before the checkout on the path (a project's own `data/`), the import
raises one ImportError naming that package's folder and what to do.

**The library under the commands.** This package's modules are what this API and the commands (tools.tokenize,
tools.encode, tools.evaluate, tools.extract, tools.export) share: a codec read from a run, a checkpoint or an export
(codec_files.py), the codes asked of it (codes_spec.py), the features it was trained on and what computes them
(trained_features.py), the input pipeline and what a shard records of it (pipeline_settings.py), the codec over
audio (audio_codec.py), a codec over a feature store (feature_check.py), and a shard of codes (code_shard.py). They
import no command; `import rvq_tokenizer` itself imports none of them.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rvq_tokenizer.tokenizer import RVQTokenizer

__all__ = ["load", "RVQTokenizer", "CodecInfo"]
CHECKOUT = Path(__file__).resolve().parent.parent
# the checkout's packages the library imports by these names (tools/ it never imports, so a project's own `tools`
# does not stand in its way)
NEEDED = ("errors", "data", "models", "training")


def load(source: str | os.PathLike, *, device: str = "auto", precision: str | None = None,
         w2v_bert: str | os.PathLike | None = None) -> RVQTokenizer:
    """The tokenizer of a trained codec, read once.

    Args:
        source: a run's folder (the trainer's --output_dir: its newest checkpoint, once the run has ended), one of
            its checkpoint files, or a folder `python -m tools.export` wrote.
        device: "auto" (a GPU where there is one), "cpu", "cuda", "cuda:1" ...
        precision: w2v-BERT's, which must be the codec's ("fp32" or "bf16"; None: the codec's).
        w2v_bert: the w2v-BERT folder, where it is not where the codec recorded it (its files must be the same
            model).

    Returns:
        An RVQTokenizer: `encode`, `encode_files`, `features`, `decode` (help() on each), `info`.

    Raises:
        ValueError: naming the argument, for a source that holds no codec (or a codec trained on features that are
            not audio's, such as the demo corpus), a run still training, a device that is not there, a precision or
            w2v_bert that is not the codec's.

    Example:
        >>> import rvq_tokenizer
        >>> tokenizer = rvq_tokenizer.load("runs/mine", device="cpu")
        >>> tokenizer.info.levels, tokenizer.frame_rate
        (8, 50.0)
    """
    from rvq_tokenizer.tokenizer import open_tokenizer

    return open_tokenizer(source, device=device, precision=precision, w2v_bert=w2v_bert)


def __getattr__(name: str):
    """RVQTokenizer and CodecInfo, from their module once asked for (it imports the codec's libraries)."""
    if name in ("RVQTokenizer", "CodecInfo"):
        from rvq_tokenizer import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module 'rvq_tokenizer' has no attribute {name!r}")


def shadowing_packages() -> list[tuple[str, str, bool]]:
    """(name, its folder or file, whether this process has imported it already) for each of NEEDED that the import
    system would take from elsewhere than this checkout. Nothing is imported to find out."""
    found = []
    for name in NEEDED:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None) if module is not None else importlib.util.find_spec(name)
        locations = list(getattr(spec, "submodule_search_locations", None) or []) if spec else []
        origin = getattr(spec, "origin", None) if spec else None
        if locations:  # a package: its folder
            homes, shown = {Path(p).resolve().parent for p in locations}, locations[0]
        elif origin and origin not in ("built-in", "frozen"):  # a module: its file
            homes, shown = {Path(origin).resolve().parent}, origin
        else:
            homes, shown = set(), "not found on the path"
        if CHECKOUT not in homes:
            found.append((name, shown, module is not None))
    return found


def _refuse_a_shadowed_checkout() -> None:
    """ImportError naming each package that stands in the way of the checkout's own, and what to do."""
    shadowed = shadowing_packages()
    if not shadowed:
        return
    named = "; ".join(f"'{name}' is {place}" + (" (imported already)" if imported else "")
                      for name, place, imported in shadowed)
    raise ImportError(
        f"rvq_tokenizer needs the packages {', '.join(map(repr, NEEDED))} of its checkout {CHECKOUT}, and the "
        f"import path gives others: {named}. Put the checkout first on the path before anything imports those "
        f"names (sys.path.insert(0, {str(CHECKOUT)!r}), or PYTHONPATH={CHECKOUT} with no folder of such packages "
        "before it), or rename your own package: two packages of one name cannot share a process")


_refuse_a_shadowed_checkout()
