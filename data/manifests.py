"""fairseq audio manifests: the root folder on the first line, then `relpath<TAB>num_samples` per file.

A manifest (or a folder of audio files) says what to extract; the extractor
writes one beside each shard of a dump (`{split}_{rank}_{nshard}.tsv`, samples
at 16 kHz), so that features and codes can be matched to their audio files.

A manifest is read as UTF-8 (a leading byte-order mark ignored), bytes that are not UTF-8 kept as surrogate
escapes, as Python names such files on disk. A written .tsv holds only UTF-8 lines: a file whose name is not
UTF-8, or holds a line break or a tab, is skipped and listed (`name_problem`), its name escaped in the list.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from data.shard_layout import FEATURE_DUMP
from errors import BadInputError

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")


def read_manifest(path: Path) -> tuple[Path, list[str]]:
    """(root, relpaths) of a fairseq manifest: the root folder, then `relpath<TAB>num_samples` lines. A relative
    root is the manifest's folder's, returned absolute: the .tsv written from it names the same folder from any
    working directory."""
    # split on newlines only: splitlines() would also cut a name at a form feed or U+2028
    lines = path.read_text(encoding="utf-8-sig", errors="surrogateescape").split("\n")
    if not lines or not lines[0].strip():
        raise BadInputError(f"manifest {path} is empty: its first line must be the root folder of the audio, "
                            "then one `relpath<TAB>num_samples` line per file")
    root = Path(lines[0].strip())
    if not root.is_absolute():
        root = (path.parent / root).absolute()
    entries = [line.split("\t")[0] for line in lines[1:] if line.strip()]
    if not entries:
        raise BadInputError(f"manifest {path} lists no files (only the root line {lines[0]!r})")
    if not root.is_dir():
        raise BadInputError(f"manifest {path}: its root folder {root} (first line) does not exist")
    return root, entries


def name_problem(rel: str) -> str | None:
    """Why the output .tsv cannot hold this file's name (the reason it is skipped), or None."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return ("its name is not UTF-8, which a .tsv of UTF-8 lines cannot hold: rename it (convmv -f latin1 "
                "-t utf8, for example)")
    if any(c in rel for c in "\n\r\t"):
        return "its name holds a line break or a tab, which would split its .tsv line: rename it"
    return None


def shown_name(rel: str) -> str:
    """The name as one UTF-8 line of a list can hold it: bytes that are not UTF-8 as \\xNN, \\n \\r \\t escaped."""
    text = rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.translate({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def list_audio_folder(folder: Path) -> list[str]:
    """The audio files under `folder` by their paths under it, sorted. A link to nothing is one too: it is skipped
    as missing and listed, as in a manifest, not lost without a word."""
    found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES
                   and (p.is_file() or (p.is_symlink() and not p.exists())))
    if not found:
        raise BadInputError(f"no audio files ({', '.join(AUDIO_SUFFIXES)}) found under {folder}")
    return found


def manifest_lines(root: str | Path, lines: Iterable[str]) -> Iterator[str]:
    """A manifest's text line by line (newline included): its root, then its `relpath<TAB>num_samples` lines."""
    yield f"{root}\n"
    for line in lines:
        yield f"{line}\n"


def share_manifest(data_dir: Path, split: str, utterances: int, start: int,
                   end: int) -> tuple[str, Iterator[str]] | None:
    """(root, `relpath<TAB>samples` lines) of utterances start..end-1 of a dump's split, from the .tsv beside each
    shard; None when the split has no such manifests or they do not describe its `utterances` utterances. The
    files are read line by line: nothing held grows with the split."""
    shards = {}
    for path in sorted(data_dir.glob(f"{split}_*_*{FEATURE_DUMP.lengths}")):
        parts = path.name[len(split) + 1 : -len(FEATURE_DUMP.lengths)].split("_")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            shards[(int(parts[1]), int(parts[0]))] = path
    if not shards or len({n for n, _ in shards}) != 1:
        return None
    tsvs, roots, total = [], set(), 0
    for key in sorted(shards):
        tsv = shards[key].with_name(shards[key].name[: -len(FEATURE_DUMP.lengths)] + FEATURE_DUMP.keys)
        if not tsv.is_file():
            return None
        with open(tsv, encoding="utf-8", errors="surrogateescape") as f:
            roots.add(f.readline().rstrip("\n"))
            rows = sum(1 for line in f if line.strip())
        with open(shards[key]) as f:
            if rows != sum(1 for line in f if line.strip()):
                return None  # not the manifest of this dump
        tsvs.append(tsv)
        total += rows
    if len(roots) != 1 or total != utterances:
        return None
    return roots.pop(), _lines_between(tsvs, start, end)


def _lines_between(tsvs: list[Path], start: int, end: int) -> Iterator[str]:
    """Entry lines start..end-1 of these manifests taken as one list (each file's root line skipped)."""
    index = 0
    for tsv in tsvs:
        with open(tsv, encoding="utf-8", errors="surrogateescape") as f:
            f.readline()
            for line in f:
                if not line.strip():
                    continue
                if index >= end:
                    return
                if index >= start:
                    yield line.rstrip("\n")
                index += 1
