"""Phone alignments of a split's utterances, as frame labels at the features' frame rate, in the formats users
have them:

- fairseq-style frame labels (`.phn`, or any file that is neither .ctm nor a folder): one line per utterance,
  in the split's order, space-separated labels, one per feature frame;
- Praat TextGrid files as the Montreal Forced Aligner writes them: a folder of NAME.TextGrid, each with an
  interval tier named "phones" (long or short text format, UTF-8 or UTF-16); an empty interval is silence;
- CTM (`.ctm`): `utt channel start duration phone` lines (`;;` comments skipped); frames no phone covers
  (CTM leaves silences out) are silence.

TextGrid and CTM are matched to utterances by name (the audio file's stem, from the dump's .tsv manifests, or
the feature file's stem in a folder store) and given in seconds: feature frame i (0-based) takes the label at
its centre, (i + 0.5) / frame_rate seconds.

What is checked, each failure a BadInputError naming the first bad utterance (the tool exits 2): every
utterance has an alignment; a .phn line has the utterance's feature frames, one more or one fewer at most
(fitted by cutting the last label or repeating it); a TextGrid's duration (its xmax) in whole frames is within
one of the feature frames, and a CTM's last phone ends within one frame of the features' end, at most (a CTM
need not reach the end: a final silence is left out). A count about 2x or 0.5x the frames is named as what it
most likely is: labels at another frame rate.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.manifests import share_manifest
from errors import BadInputError

SILENCE = "sil"  # the label of an empty TextGrid interval and of frames no CTM line covers
PHONE_TIER = "phones"  # the Montreal Forced Aligner's tier of phones
SLACK = 1  # frames an alignment may differ from the features by
# Praat's text formats (long and short) hold the same values in the same order: quoted strings (a quote doubled
# inside), numbers, <exists>/<absent> flags; the long format's `item [1]:` indices are skipped
_PRAAT_TOKEN = re.compile(r'"((?:[^"]|"")*)"|(<exists>|<absent>)|(\[\d*\])|([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)')


@dataclass
class Alignments:
    """Frame labels of every utterance (int phone ids at the features' frame rate, each as long as the
    utterance's features), the phones they number, and where they came from."""

    labels: list[np.ndarray]
    phones: list[str]
    source: str


def alignment_format(path: Path) -> str:
    """`textgrid` (a folder), `ctm` (a .ctm file) or `phn` (any other file)."""
    if path.is_dir():
        return "textgrid"
    return "ctm" if path.suffix.lower() == ".ctm" else "phn"


def read_alignments(path: str | Path, frames: np.ndarray, names: list[str] | None, frame_rate: float,
                    describe=None) -> Alignments:
    """The frame labels of utterances of `frames` feature frames each, from the alignments at `path` (format by
    alignment_format). `names`: the utterances' names (TextGrid and CTM are matched by them); describe(i): the
    utterance for a message (default: its name, or its position)."""
    path = Path(path)
    frames = np.asarray(frames, dtype=np.int64)
    shown = describe or (lambda i: f"utterance {i} ({names[i]})" if names else f"utterance {i}")
    if not path.exists():
        raise BadInputError(f"--alignments {path} does not exist: give a .phn file of frame labels, a folder of "
                            "TextGrid files or a .ctm file")
    kind = alignment_format(path)
    if kind != "phn":
        if names is None:
            raise BadInputError(f"--alignments {path}: {kind} alignments are matched to utterances by name, and this "
                                "split's names are unknown (no .tsv manifest beside the dump, as tools.extract "
                                "writes): give frame labels in the split's order (a .phn file) instead")
        repeated = sorted(n for n, count in Counter(names).items() if count > 1)
        if repeated:
            raise BadInputError(f"--alignments {path}: utterances share the name {repeated[0]!r}, so a {kind} "
                                "alignment cannot be matched to one: give frame labels (a .phn file) instead")
    if kind == "phn":
        text = _frame_label_lines(path, frames, shown)
    elif kind == "textgrid":
        text = [_textgrid_labels(path, name, int(n), frame_rate, shown(i))
                for i, (name, n) in enumerate(zip(names, frames))]
    else:
        text = _ctm_labels(path, names, frames, frame_rate, shown)
    phones = sorted({label for labels in text for label in labels})
    index = {phone: i for i, phone in enumerate(phones)}
    labels = [np.fromiter((index[label] for label in line), dtype=np.int64, count=len(line)) for line in text]
    return Alignments(labels, phones, f"{kind} alignments {path}")


def labels_at_code_rate(labels: np.ndarray, downsample: int) -> np.ndarray:
    """Labels of T feature frames -> those of its ceil(T / downsample) code frames: each code frame takes the label
    of its first feature frame (frames j*downsample .. j*downsample + downsample - 1 make code frame j)."""
    return np.asarray(labels)[::downsample]


def _rate_hint(count: int, frames: int) -> str:
    ratio = count / max(frames, 1)
    for factor in (2, 4, 0.5, 0.25):
        if frames > 4 and abs(ratio / factor - 1) < 0.15:
            return f" (about {factor:g}x: labels at another frame rate?)"
    return ""


def check_frames(count: int, frames: int, what: str, where: str, unit: str = "labels") -> None:
    """BadInputError unless `count` is within SLACK of the utterance's `frames` feature frames."""
    if abs(count - frames) > SLACK or count == 0:
        raise BadInputError(f"{where}: {what} has {count} {unit} for {frames} feature frames (at most {SLACK} "
                            f"apart){_rate_hint(count, frames)}")


def fit_length(labels: list[str], frames: int, what: str, where: str) -> list[str]:
    """`labels` cut or extended (the last repeated) to `frames`; BadInputError when they differ by more than
    SLACK."""
    check_frames(len(labels), frames, what, where)
    return labels[:frames] + labels[-1:] * (frames - len(labels))


def _frame_label_lines(path: Path, frames: np.ndarray, shown) -> list[list[str]]:
    lines = [line.split() for line in path.read_text(errors="replace").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    out = []
    for i, n in enumerate(frames):
        if i >= len(lines):
            raise BadInputError(f"{shown(i)}: no alignment: {path} has {len(lines)} lines for {len(frames)} "
                                "utterances (one line of frame labels per utterance, in the split's order)")
        out.append(fit_length(lines[i], int(n), f"line {i + 1} of {path.name}", shown(i)))
    if len(lines) > len(frames):
        raise BadInputError(f"{path} has {len(lines)} lines for the split's {len(frames)} utterances: they are "
                            "not its frame labels (one line per utterance, in the split's order)")
    return out


def _centres(frames: int, frame_rate: float) -> np.ndarray:
    return (np.arange(frames) + 0.5) / frame_rate


def _labels_at(starts: np.ndarray, ends: np.ndarray, texts: list[str], frames: int, frame_rate: float) -> list[str]:
    """Each frame's label: the interval (sorted by start, [start, end)) its centre falls in; SILENCE where none
    does."""
    if not len(starts):
        return [SILENCE] * frames
    centres = _centres(frames, frame_rate)
    which = np.searchsorted(starts, centres, side="right") - 1
    inside = (which >= 0) & (centres < ends[np.maximum(which, 0)])
    return [texts[j] if ok else SILENCE for j, ok in zip(which.tolist(), inside.tolist())]


def read_textgrid_tiers(path: Path) -> dict[str, tuple[float, list[tuple[float, float, str]]]]:
    """Interval tiers of a Praat TextGrid (long or short text format): name -> (xmax, [(xmin, xmax, text)])."""
    raw = path.read_bytes()
    encoding = "utf-16" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8-sig"
    values = []
    for m in _PRAAT_TOKEN.finditer(raw.decode(encoding, errors="replace")):
        if m.group(1) is not None:
            values.append(m.group(1).replace('""', '"'))
        elif m.group(2) is not None:
            values.append(m.group(2))
        elif m.group(4) is not None:
            values.append(float(m.group(4)))
    try:
        if values[:2] != ["ooTextFile", "TextGrid"]:
            raise ValueError("no 'ooTextFile' 'TextGrid' header")
        position, tiers = 6 if values[4] == "<exists>" else 5, {}
        for _ in range(int(values[position - 1]) if values[4] == "<exists>" else 0):
            kind, name, _xmin, xmax, count = values[position : position + 5]
            position += 5
            width = 3 if kind == "IntervalTier" else 2
            items = values[position : position + width * int(count)]
            position += width * int(count)
            if kind == "IntervalTier":
                tiers[name] = (float(xmax), [(float(items[k]), float(items[k + 1]), str(items[k + 2]))
                                             for k in range(0, len(items), 3)])
    except (ValueError, TypeError, IndexError) as e:
        raise BadInputError(f"{path} is not a readable Praat TextGrid ({e})") from None
    return tiers


def _textgrid_labels(folder: Path, name: str, frames: int, frame_rate: float, where: str) -> list[str]:
    path = folder / f"{name}.TextGrid"
    if not path.is_file():
        raise BadInputError(f"{where}: no alignment: {folder} has no {path.name}")
    tiers = read_textgrid_tiers(path)
    if PHONE_TIER not in tiers:
        raise BadInputError(f"{where}: {path} has no interval tier named {PHONE_TIER!r} (its tiers: "
                            f"{', '.join(repr(t) for t in tiers) or 'none'}), as the Montreal Forced Aligner writes")
    xmax, intervals = tiers[PHONE_TIER]
    whole = math.floor(xmax * frame_rate + 1e-6)
    check_frames(whole, frames, f"{path.name} ({xmax:g} s at {frame_rate:g} Hz)", where, unit="whole frames")
    intervals = sorted(intervals)
    starts = np.array([a for a, _, _ in intervals])
    ends = np.array([b for _, b, _ in intervals])
    texts = [t.strip() or SILENCE for _, _, t in intervals]
    labels = _labels_at(starts, ends, texts, frames, frame_rate)
    last = len(intervals) - 1  # a frame centred past the tier's end (one frame at most) takes its last label
    return [texts[last] if c >= xmax and intervals else label
            for c, label in zip(_centres(frames, frame_rate).tolist(), labels)]


def _ctm_labels(path: Path, names: list[str], frames: np.ndarray, frame_rate: float, shown) -> list[list[str]]:
    by_utterance: dict[str, list[tuple[float, float, str]]] = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith(";;"):
            continue
        try:
            start, duration = float(words[2]), float(words[3])
            phone = words[4]
        except (IndexError, ValueError):
            raise BadInputError(f"{path} line {number}: {line.strip()!r} is not `utt channel start duration phone`") \
                from None
        by_utterance.setdefault(words[0], []).append((start, start + duration, phone))
    out = []
    for i, (name, n) in enumerate(zip(names, frames.tolist())):
        if name not in by_utterance:
            raise BadInputError(f"{shown(i)}: no alignment: {path} has no line for {name!r}")
        intervals = sorted(by_utterance[name])
        end = max(b for _, b, _ in intervals)
        whole = math.floor(end * frame_rate + 1e-6)
        if whole > n + SLACK:
            raise BadInputError(f"{shown(i)}: its last phone in {path.name} ends at {end:g} s, frame {whole} at "
                                f"{frame_rate:g} Hz, past its {n} feature frames (at most {SLACK} apart)"
                                f"{_rate_hint(whole, n)}")
        out.append(_labels_at(np.array([a for a, _, _ in intervals]), np.array([b for _, b, _ in intervals]),
                              [t for _, _, t in intervals], n, frame_rate))
    return out


def utterance_names(data_dir: Path, split: str, store) -> list[str] | None:
    """The names of a split's utterances, which TextGrid and CTM alignments go by: the stems of their audio files
    from the .tsv manifests tools.extract writes beside a dump's shards, or of the files of a folder store; None
    when neither says."""
    found = share_manifest(Path(data_dir), split, len(store), 0, len(store))
    if found is not None:
        return [Path(line.split("\t")[0]).stem for line in found[1]]
    if store.sources and all(isinstance(source, Path) for source in store.sources):
        return [Path(store.sources[int(s)]).stem for s in store.shard]
    return None
