"""fairseq audio manifests: the root folder on the first line, then `relpath<TAB>num_samples` per file.

A manifest (or a folder of audio files) says what to extract; the extractor
writes one beside each shard of a dump (`{split}_{rank}_{nshard}.tsv`, samples
at 16 kHz), so that features and codes can be matched to their audio files.
"""
from __future__ import annotations

from pathlib import Path

from errors import BadInputError

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")


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
    """(root, relpaths) of a manifest, or of the audio files under a folder, in order."""
    if not source.exists():
        raise BadInputError(f"{source} does not exist: give a fairseq manifest (.tsv) or a folder of audio files")
    if source.is_dir():
        return source.resolve(), list_audio_folder(source)
    return read_manifest(source)


def manifest_text(root: str | Path, lines: list[str]) -> str:
    """A manifest's text from its root and its `relpath<TAB>num_samples` lines."""
    return f"{root}\n" + "".join(f"{line}\n" for line in lines)


def split_manifest(data_dir: Path, split: str, utterances: int) -> tuple[str, list[str]] | None:
    """(root, `relpath<TAB>samples` lines) for every utterance of a dump's split, from the .tsv beside each
    shard; None when the split has no such manifests or they do not describe its `utterances` utterances."""
    shards = {}
    for path in sorted(data_dir.glob(f"{split}_*_*.len")):
        parts = path.stem[len(split) + 1 :].split("_")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            shards[(int(parts[1]), int(parts[0]))] = path
    if not shards or len({n for n, _ in shards}) != 1:
        return None
    roots, lines = set(), []
    for key in sorted(shards):
        tsv = shards[key].with_suffix(".tsv")
        if not tsv.is_file():
            return None
        rows = tsv.read_text().splitlines()
        if len(rows) - 1 != len(shards[key].read_text().split()):
            return None  # not the manifest of this dump
        roots.add(rows[0])
        lines.extend(rows[1:])
    if len(roots) != 1 or len(lines) != utterances:
        return None
    return roots.pop(), lines
