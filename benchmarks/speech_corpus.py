"""Real speech features for the quality benchmark: espeak-ng speech -> the Seamless front-end (160-d fbank, 50 Hz).

Synthesises a few hundred English utterances with espeak-ng (several voices and
variants, speaking rates and pitches, sentences of varied text drawn from a fixed
seed), then runs `python -m tools.extract DIR SPLIT 1 0 OUT --feature fbank` on the
train and valid folders. The valid utterances are other sentences than the train
ones. Needs `apt-get install espeak-ng` and requirements-extract.txt.

    python benchmarks/speech_corpus.py [--out .cache/speech_corpus] [--utterances 400]

The result is a fairseq dump (train_0_1.npy/.len, valid_0_1.npy/.len) for --data_dir.
"""
from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / ".cache" / "speech_corpus"))
    parser.add_argument("--utterances", type=int, default=400)
    parser.add_argument("--valid_every", type=int, default=10, help="every Nth utterance is held out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng not found: apt-get install espeak-ng")
    out = Path(args.out)
    if (out / "valid_0_1.len").exists():
        print(f"{out} already holds the speech corpus")
        return 0
    rng = random.Random(args.seed)
    wav = out / "wav"
    jobs = []
    for i in range(args.utterances):
        split = "valid" if i % args.valid_every == args.valid_every - 1 else "train"
        voice = rng.choice(VOICES) + rng.choice(VARIANTS)
        folder = wav / split
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((folder / f"utt{i:04d}.wav", sentence(rng), voice, rng.randint(120, 230), rng.randint(20, 80)))
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        list(pool.map(synthesise, jobs))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for split in ("train", "valid"):
        subprocess.run([sys.executable, "-m", "tools.extract", str(wav / split), split, "1", "0", str(out),
                        "--feature", "fbank"], check=True, cwd=REPO, env=env)
    print(f"speech corpus in {out}: {args.utterances} utterances")
    return 0


if __name__ == "__main__":
    sys.exit(main())
