"""Real speech features for the quality benchmark: espeak-ng speech -> the Seamless front-end (160-d fbank, 50 Hz),
with phone labels per feature frame from espeak-ng's own phoneme timings.

Synthesises a few hundred English utterances with espeak-ng (several voices and
variants, speaking rates and pitches, sentences of varied text drawn from a fixed
seed), then runs `python -m tools.extract DIR SPLIT 1 0 OUT --feature fbank` on the
train and valid folders. The valid utterances are other sentences than the train
ones. Needs `apt-get install espeak-ng` and requirements-extract.txt.

    python benchmarks/speech_corpus.py [--out .cache/speech_corpus] [--utterances 400] [--no_labels]

The result is a fairseq dump (train_0_1.npy/.len/.tsv, valid_0_1.npy/.len/.tsv) for --data_dir, and beside it
the phone labels `train.phn` and `valid.phn` (docs/evaluating-codes.md: one line per utterance in the dump's
order, one label per feature frame), which the trainer's final eval and `tools.evaluate --alignments` read.

The labels: each utterance is synthesised through libespeak-ng itself (ctypes, a fresh process for each; the same
library, voice, rate and pitch as the `espeak-ng -w` command line, and the same samples, bit for bit), which reports
each phoneme's start as it renders it (espeakEVENT_PHONEME, `audio_position` in ms, espeak's phoneme mnemonics: `D`,
`I2`, `oU`, ...). A phoneme lasts until the next one starts (the last until the end of the audio); feature frame i
takes the phoneme at its centre, (i + 0.5) / 50 s. espeak's pauses (phonemes `_`, `_:`, `_!`, ...) and the frames
before the first phoneme or past the audio are `sil`. The phoneme events of every utterance are also kept, in
`OUT/phonemes/{split}.jsonl` (wav name, samples, sample rate, [ms, phoneme] pairs). `--no_labels` synthesises with
the espeak-ng command line, as before, and writes no labels.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbcwmd"]
VARIANTS = ["", "+m1", "+m3", "+m5", "+f1", "+f2", "+f4", "+klatt", "+croak", "+whisper"]
SUBJECTS = ["the old sailor", "my neighbour", "a tired student", "the committee", "every child", "our pilot",
            "the small dog", "this engine", "her brother", "the orchestra", "a quiet farmer", "the new manager"]
VERBS = ["painted", "carried", "forgot", "measured", "repaired", "described", "borrowed", "noticed", "sold",
         "cleaned", "followed", "imagined", "questioned", "delivered"]
OBJECTS = ["seven yellow boxes", "the broken window", "a strange letter", "twelve heavy stones", "the long bridge",
           "a bottle of cold water", "three thousand coins", "the northern valley", "an empty theatre",
           "the purple umbrella", "fifty sheep", "a jar of honey", "the midnight train"]
TAILS = ["before the storm arrived", "while everyone was sleeping", "near the harbour", "on Thursday morning",
         "without saying a word", "because it was raining", "in nineteen eighty four", "at a quarter past nine",
         "during the long winter", "with surprising patience", "", ""]
QUESTIONS = ["why", "when", "how quickly", "where exactly"]

FRAME_RATE = 50  # feature frames per second (the Seamless fbank: 10 ms hop, 2 frames stacked)
SILENCE = "sil"  # the label of espeak's pauses and of frames no phoneme covers
DURATION_SLACK = 2  # feature frames the audio's duration x 50 may differ from the dump's frame count by

# libespeak-ng's speak_lib.h
AUDIO_OUTPUT_SYNCHRONOUS = 2
INITIALIZE_PHONEME_EVENTS = 0x0001
EVENT_LIST_TERMINATED, EVENT_PHONEME = 0, 7
POS_CHARACTER = 1
CHARS_AUTO, PHONEMES, ENDPAUSE = 0, 0x100, 0x1000  # the command line's synth flags
ESPEAK_RATE, ESPEAK_PITCH = 1, 3
EE_OK = 0


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}".strip()
    kind = rng.random()
    if kind < 0.2:
        return f"{rng.choice(QUESTIONS).capitalize()} do you think {s}?"
    if kind < 0.4:
        return f"{s.capitalize()}, and then {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
    return s.capitalize() + "."


def synthesise(job) -> None:
    path, text, voice, rate, pitch = job
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "-w", str(path), text],
                   check=True, capture_output=True)


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):  # espeak_EVENT
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _EventId)]


class _Voice(ctypes.Structure):  # espeak_VOICE
    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_char_p), ("identifier", ctypes.c_char_p),
                ("gender", ctypes.c_ubyte), ("age", ctypes.c_ubyte), ("variant", ctypes.c_ubyte),
                ("xx1", ctypes.c_ubyte), ("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


class Espeak:
    """libespeak-ng in this process, synchronous, with phoneme events: `synthesise(text, voice, rate, pitch)` ->
    (int16 samples, [(start ms, phoneme), ...]). One a process: the library's state is global."""

    def __init__(self):
        import numpy as np

        self.np = np
        self.lib = ctypes.CDLL("libespeak-ng.so.1")
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                          ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.sample_rate = self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, None, INITIALIZE_PHONEME_EVENTS)
        if self.sample_rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({self.sample_rate}): is espeak-ng-data installed?")
        self.chunks, self.events = [], []
        self.callback = _CALLBACK(self._collect)  # kept: the library holds only the pointer
        self.lib.espeak_SetSynthCallback(self.callback)

    def _collect(self, wav, count, events) -> int:
        if wav and count > 0:
            self.chunks.append(self.np.ctypeslib.as_array(wav, (count,)).copy())
        i = 0
        while events[i].type != EVENT_LIST_TERMINATED:
            if events[i].type == EVENT_PHONEME:
                self.events.append((int(events[i].audio_position), events[i].id.string.decode("utf-8", "replace")))
            i += 1
        return 0

    def synthesise(self, text: str, voice: str, rate: int, pitch: int):
        # as the command line's -v: by name, else by language (`en-gb+m5`: no voice is named en-gb)
        if self.lib.espeak_SetVoiceByName(voice.encode()) != EE_OK:
            select = _Voice(languages=voice.encode())
            if self.lib.espeak_SetVoiceByProperties(ctypes.byref(select)) != EE_OK:
                raise RuntimeError(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(ESPEAK_RATE, rate, 0)
        self.lib.espeak_SetParameter(ESPEAK_PITCH, pitch, 0)
        self.chunks, self.events = [], []
        data = text.encode()
        if self.lib.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, CHARS_AUTO | PHONEMES | ENDPAUSE,
                                 None, None) != EE_OK:
            raise RuntimeError(f"espeak_Synth failed on {text!r}")
        self.lib.espeak_Synchronize()
        samples = self.np.concatenate(self.chunks) if self.chunks else self.np.zeros(0, self.np.int16)
        return samples, sorted(self.events, key=lambda e: e[0])


_espeak: Espeak | None = None


def synthesise_with_phonemes(job) -> dict:
    """The job's wav written as `espeak-ng -w` writes it (16-bit mono at the library's rate), and its phoneme
    events; meant for a fresh worker process (see main)."""
    global _espeak
    import soundfile

    if _espeak is None:
        _espeak = Espeak()
    path, text, voice, rate, pitch = job
    samples, events = _espeak.synthesise(text, voice, rate, pitch)
    soundfile.write(str(path), samples, _espeak.sample_rate, subtype="PCM_16")
    return {"wav": Path(path).name, "samples": len(samples), "sample_rate": _espeak.sample_rate,
            "text": text, "voice": voice, "phonemes": events}


def frame_labels(record: dict, frames: int) -> list[str]:
    """One label per feature frame: the phoneme whose span holds the frame's centre, pauses and frames outside
    every phoneme `sil`."""
    events = record["phonemes"]
    end_ms = 1000.0 * record["samples"] / record["sample_rate"]
    starts = [ms for ms, _ in events] + [end_ms]
    labels, k = [], -1
    for i in range(frames):
        t = 1000.0 * (i + 0.5) / FRAME_RATE
        while k + 1 < len(events) and starts[k + 1] <= t:
            k += 1
        if k < 0 or t >= starts[k + 1]:
            labels.append(SILENCE)
        else:
            phone = events[k][1]
            labels.append(SILENCE if phone.startswith("_") or not phone.strip() else phone)
    return labels


def write_labels(out: Path, split: str, records: dict[str, dict]) -> tuple[int, int]:
    """`out/{split}.phn` in the dump's order (its .tsv manifest names each row's wav; its .len the frames);
    (utterances, frames). SystemExit when a row has no phoneme events or its audio is not its frames' length."""
    tsv = (out / f"{split}_0_1.tsv").read_text().splitlines()[1:]
    lengths = [int(n) for n in (out / f"{split}_0_1.len").read_text().split()]
    if len(tsv) != len(lengths):
        sys.exit(f"{out}/{split}_0_1: {len(tsv)} manifest rows for {len(lengths)} lengths")
    lines = []
    for row, frames in zip(tsv, lengths):
        name = Path(row.split("\t")[0]).name
        if name not in records:
            sys.exit(f"{split}: no phoneme events for {name}")
        record = records[name]
        seconds = record["samples"] / record["sample_rate"]
        if abs(seconds * FRAME_RATE - frames) > DURATION_SLACK:
            sys.exit(f"{split}: {name} is {seconds:.3f} s of audio ({seconds * FRAME_RATE:.1f} frames at "
                     f"{FRAME_RATE} Hz) but has {frames} feature frames")
        labels = frame_labels(record, frames)
        assert len(labels) == frames
        lines.append(" ".join(labels))
    (out / f"{split}.phn").write_text("".join(line + "\n" for line in lines))
    return len(lines), sum(lengths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / ".cache" / "speech_corpus"))
    parser.add_argument("--utterances", type=int, default=400)
    parser.add_argument("--valid_every", type=int, default=10, help="every Nth utterance is held out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_labels", action="store_true",
                        help="synthesise with the espeak-ng command line and write no phone labels (train.phn, "
                             "valid.phn)")
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng not found: apt-get install espeak-ng")
    out = Path(args.out)
    if (out / "valid_0_1.len").exists():
        if args.no_labels or (out / "valid.phn").exists():
            print(f"{out} already holds the speech corpus")
            return 0
        if not (out / "phonemes" / "valid.jsonl").exists():
            sys.exit(f"{out} holds a speech corpus without phoneme events (made with --no_labels or before them): "
                     "build it again elsewhere (--out) for its phone labels")
    rng = random.Random(args.seed)
    wav = out / "wav"
    jobs = {"train": [], "valid": []}
    for i in range(args.utterances):
        split = "valid" if i % args.valid_every == args.valid_every - 1 else "train"
        voice = rng.choice(VOICES) + rng.choice(VARIANTS)
        folder = wav / split
        folder.mkdir(parents=True, exist_ok=True)
        jobs[split].append((folder / f"utt{i:04d}.wav", sentence(rng), voice, rng.randint(120, 230),
                            rng.randint(20, 80)))
    if not (out / "valid_0_1.len").exists():
        if args.no_labels:
            with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
                list(pool.map(synthesise, [job for split in jobs for job in jobs[split]]))
        else:
            (out / "phonemes").mkdir(parents=True, exist_ok=True)
            import numpy  # noqa: F401  (imported once, before the workers fork)
            import soundfile  # noqa: F401

            # a fresh process (a fresh library) for each utterance: libespeak-ng carries state from one utterance
            # to the next (the same job synthesised twice in one process differs by a few ms), and in a fresh
            # one its samples are those of the `espeak-ng -w` command line, bit for bit
            with multiprocessing.get_context("fork").Pool(os.cpu_count() or 2, maxtasksperchild=1) as pool:
                for split, split_jobs in jobs.items():
                    records = pool.map(synthesise_with_phonemes, split_jobs, chunksize=1)
                    with open(out / "phonemes" / f"{split}.jsonl", "w") as f:
                        f.writelines(json.dumps(record) + "\n" for record in records)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for split in ("train", "valid"):
            subprocess.run([sys.executable, "-m", "tools.extract", str(wav / split), split, "1", "0", str(out),
                            "--feature", "fbank"], check=True, cwd=REPO, env=env)
    if not args.no_labels:
        for split in ("train", "valid"):
            with open(out / "phonemes" / f"{split}.jsonl") as f:
                records = {r["wav"]: r for r in map(json.loads, f)}
            utterances, frames = write_labels(out, split, records)
            print(f"{out}/{split}.phn: {utterances} utterances, {frames} frames labelled")
    print(f"speech corpus in {out}: {args.utterances} utterances")
    return 0


if __name__ == "__main__":
    sys.exit(main())
