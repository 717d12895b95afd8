"""How a message says that settings changed: `key: was -> now`, one wording for every check that refuses (or
reports) a change, whether of a shard's settings, a codec's features, a run's data or its codec."""
from __future__ import annotations

from collections.abc import Callable, Iterable


def changes(was: dict, now: dict, keys: Iterable[str] | None = None, *, show: Callable[[object], str] = repr,
            word: Callable[[str, object, object], str] | None = None,
            skip: Callable[[str], bool] = lambda key: False) -> list[str]:
    """`key: was[key] -> now[key]` for each of `keys` (default: now's) whose values differ, in that order, each value
    as `show` gives it; `word(key, was, now)`, where given, words them otherwise (a flag as it is typed, say);
    `skip(key)` leaves a key out."""
    word = word or (lambda key, a, b: f"{key}: {show(a)} -> {show(b)}")
    return [word(key, was.get(key), now.get(key)) for key in (now if keys is None else keys)
            if was.get(key) != now.get(key) and not skip(key)]
