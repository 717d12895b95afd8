"""rvq_tokenizer's door: every input a Python user may give taken as meant or refused by name, in Python's words;
batches, tensors, levels and rates as the peers' APIs give them; help() as the manual; the README's example run as
written; an import that another `data` package cannot shadow silently. (tests/test_rvq_tokenizer.py holds the codes
against the tools' on a mixed corpus.)"""
import inspect
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import rvq_tokenizer
from tests.audio_helpers import codec_checkpoint, random_codec, write_corpus
from tests.helpers import REPO
from tools import extract, tokenize

pytestmark = pytest.mark.timeout(120)
RATE = 16000
SHARD = "train_0_1"
CORPUS = [("a.wav", 1.2, RATE, 1), ("b.wav", 0.7, RATE, 1), ("c.wav", 1.9, RATE, 1)]


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    """Three 16-kHz files, their fbank as tools.extract writes it, an untrained codec of 3 levels on it (in a run's
    folder, runs/mine), its tools.tokenize codes with all levels and with the first one, and its tokenizer."""
    root = tmp_path_factory.mktemp("door")
    write_corpus(root / "audio", CORPUS)
    assert extract.main([root / "audio", "train", 1, 0, root / "feats", "--num_workers", 0]) == 0
    run = root / "runs" / "mine"
    random_codec(run / "checkpoints" / "step_00000001.pt", root / "feats", feature_dim=160, num_quantizers=3,
                 codebook_size=32)
    for name, extra in (("codes", []), ("codes_1", ["--num_quantizers", 1])):
        assert tokenize.main([root / "audio", "train", 1, 0, root / name, "--checkpoint", run, "--num_workers", 0,
                              *extra]) == 0
    import soundfile as sf

    waves = [sf.read(root / "audio" / rel, dtype="float32")[0] for rel, *_ in CORPUS]
    return root, run, rvq_tokenizer.load(run, device="cpu"), waves


def tokenized(folder) -> list[np.ndarray]:
    codes = np.load(folder / f"{SHARD}.codes.npy")
    lengths = [int(n) for n in (folder / f"{SHARD}.codes.len").read_text().split()]
    return np.split(codes, np.cumsum(lengths)[:-1])


def refused(call, *messages) -> str:
    with pytest.raises(ValueError) as e:
        call()
    text = str(e.value)
    assert all(m in text for m in messages), text
    assert "--" not in text, text  # Python's words, never a flag
    return text


def test_a_rate_in_khz_or_beyond_what_audio_uses_is_refused_naming_hz(door):
    _, _, tokenizer, (a, *_) = door
    refused(lambda: tokenizer.encode(a, 22.05), "sample_rate 22.05 of audio: give its sample rate in Hz, from 1,000 "
                                                "to 384,000 (22050, not 22.05 kHz?)")
    refused(lambda: tokenizer.encode(a, 999), "sample_rate 999 of audio: give its sample rate in Hz, from 1,000")
    refused(lambda: tokenizer.features([a, a], [16000, 500_000]), "sample_rate 500000 of audio[1]")
    assert len(tokenizer.encode(a[::2], 8000)) == len(tokenizer.encode(a, 16000))  # a rate in range is taken


def test_two_stacked_utterances_are_never_averaged_and_each_way_to_say_what_is_meant_works(door):
    _, _, tokenizer, (a, b, _) = door
    n = min(len(a), len(b))
    stacked = np.stack([a[:n], b[:n]])  # [2, samples], as numpy users batch two utterances
    for given in (stacked, torch.from_numpy(stacked)):
        refused(lambda: tokenizer.encode(given, RATE), f"audio has shape (2, {n}): as [channels, samples] it is one "
                                                       "utterance of 2 channels, as [batch, samples] 2 utterances",
                "one utterance as [samples, channels] (audio.T)", "2 utterances as a list (list(audio))")
    each = tokenizer.encode([a[:n], b[:n]], RATE)
    for two in (tokenizer.encode(list(stacked), RATE), tokenizer.encode(stacked[:, None], RATE)):
        assert len(two) == 2 and all(np.array_equal(x, y) for x, y in zip(two, each, strict=True))
    one = tokenizer.encode(stacked.T, RATE)  # one utterance of two channels, averaged as tools.extract averages
    assert np.array_equal(one, tokenizer.encode(stacked[None], RATE)[0])
    assert np.array_equal(tokenizer.encode(a[None], RATE), tokenizer.encode(a, RATE))  # [1, samples]: one


def test_float_samples_of_pcm_scale_are_refused_and_a_loud_wave_is_taken_with_a_word(door):
    _, _, tokenizer, (a, *_) = door
    peak = f"{np.abs(a * 32768).max():,.0f}"
    refused(lambda: tokenizer.encode(a * 32768, RATE), f"audio has float samples up to {peak}: float samples are "
                                                       "read in [-1, 1], and these are integer PCM values held as "
                                                       "floats. Scale them (x / 32768 for 16-bit PCM")
    refused(lambda: tokenizer.encode([a, a * 2 ** 31], RATE), "audio[1] has float samples up to")
    with pytest.warns(UserWarning, match=r"audio has float samples up to \d+\.\d, beyond \[-1, 1\]: taken as they "
                                         r"are") as caught:
        loud = tokenizer.encode(a * 10, RATE)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert loud.shape == tokenizer.encode(a, RATE).shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenizer.encode(np.clip(a * 1.5, -2, 2), RATE)  # a little beyond full scale: no word
        tokenizer.encode((a * 32767).astype(np.int16), RATE)  # integer PCM itself: scaled as soundfile scales it


def test_a_batch_with_lengths_gives_the_codes_of_the_list_of_its_utterances_bit_for_bit(door):
    _, _, tokenizer, waves = door
    longest = max(len(w) for w in waves)
    batch = torch.zeros(len(waves), 1, longest)
    for i, w in enumerate(waves):
        batch[i, 0, : len(w)] = torch.from_numpy(w)
    lengths = torch.tensor([len(w) for w in waves])
    listed = tokenizer.encode(waves, RATE)
    batched = tokenizer.encode(batch, RATE, lengths=lengths)
    assert all(isinstance(c, torch.Tensor) and c.device == tokenizer.device and c.dtype == torch.int16
               for c in batched)
    assert all(np.array_equal(c.numpy(), want) for c, want in zip(batched, listed, strict=True))
    feats = tokenizer.features(batch.numpy(), RATE, lengths=lengths.numpy())
    assert all(np.array_equal(f, g) for f, g in zip(feats, tokenizer.features(waves, RATE), strict=True))
    refused(lambda: tokenizer.encode(batch, RATE, lengths=[5, 5]), "lengths=[5, 5]: give the samples of each of the "
                                                                   "batch's 3 utterance(s)")
    refused(lambda: tokenizer.encode(batch, RATE, lengths=lengths * 10), "integers from 1 to its")
    refused(lambda: tokenizer.encode(waves, RATE, lengths=lengths), "lengths= goes with a batch")


def test_the_codes_tools_write_for_the_files_and_the_levels_kept_per_call(door):
    root, _, tokenizer, waves = door
    want, first = tokenized(root / "codes"), tokenized(root / "codes_1")
    assert all(np.array_equal(c, w) for c, w in zip(tokenizer.encode(waves, RATE), want, strict=True))
    ones = tokenizer.encode(waves, RATE, levels=1)  # as tools.tokenize --num_quantizers 1 picks them
    assert all(c.shape[1] == 1 and np.array_equal(c, w) for c, w in zip(ones, first, strict=True))
    assert all(np.array_equal(c, w) for c, w in zip(tokenizer.encode_files(
        sorted((root / "audio").iterdir()), num_workers=0, levels=1), first, strict=True))
    for bad in (0, 4, 1.5, True):
        refused(lambda: tokenizer.encode(waves[0], RATE, levels=bad), f"levels={bad!r}: this codec has levels 1 to 3")
    assert tokenizer.kbps_per_level == 0.25  # 5 bits at 50 Hz
    assert all(np.array_equal(c, w) for c, w in zip(tokenizer.encode(waves, RATE, kbps=0.25), first, strict=True))
    for bad in (0.3, "0.25", True, float("nan")):  # no count of levels makes it, or no number
        refused(lambda: tokenizer.encode(waves[0], RATE, kbps=bad), f"kbps={bad!r}: this codec's levels make 0.25, "
                                                                     "0.5, 0.75")
    refused(lambda: tokenizer.encode(waves[0], RATE, levels=1, kbps=0.25), "give one of them")


def test_tools_keep_the_levels_a_bitrate_makes(door, tmp_path, caplog):
    """--kbps keeps the levels that make that bitrate (5 bits a level at 50 Hz: 0.25 kbps a level here), as
    --num_quantizers keeps them; a rate no count of levels makes exits 2 naming those the codec makes."""
    root, run, _, _ = door
    assert tokenize.main([root / "audio", "train", 1, 0, tmp_path / "k", "--checkpoint", run, "--num_workers", 0,
                          "--kbps", 0.25]) == 0
    assert all(np.array_equal(c, w) for c, w in zip(tokenized(tmp_path / "k"), tokenized(root / "codes_1"),
                                                    strict=True))
    assert tokenize.main([root / "audio", "train", 1, 0, tmp_path / "bad", "--checkpoint", run, "--kbps", 0.3]) == 2
    assert "--kbps 0.3: this codec's levels make 0.25, 0.5, 0.75 kbps (0.25 kbps a level: 5 bits at 50 code " \
           "frames a second)" in caplog.text and not (tmp_path / "bad").exists()


def test_tensors_in_give_tensors_out_on_the_tokenizer_s_device_and_its_rates_are_attributes(door):
    _, _, tokenizer, (a, *_) = door
    assert tokenizer.sample_rate == 16000 and tokenizer.frame_rate == 50.0 and tokenizer.levels == 3
    codes = tokenizer.encode(torch.from_numpy(a), RATE)
    assert isinstance(codes, torch.Tensor) and codes.device == tokenizer.device
    assert np.array_equal(codes.numpy(), tokenizer.encode(a, RATE))
    decoded = tokenizer.decode(codes)
    assert isinstance(decoded, torch.Tensor) and decoded.dtype == torch.float32
    assert np.array_equal(decoded.numpy(), tokenizer.decode(codes.numpy()))
    feats = tokenizer.features(torch.from_numpy(a), RATE)
    assert isinstance(feats, torch.Tensor) and np.array_equal(feats.numpy(), tokenizer.features(a, RATE))


def test_load_s_errors_name_python_s_arguments(door, tmp_path, monkeypatch):
    root, run, _, _ = door
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, whatever runs this
    refused(lambda: rvq_tokenizer.load(run, device="cuda"), "device='cuda' was asked for, but no GPU is visible",
            "use device='cpu' or device='auto'")
    refused(lambda: rvq_tokenizer.load(run, device="tpu"), "device='tpu': not a device; use 'auto', 'cpu'")
    refused(lambda: rvq_tokenizer.load(root / "audio"), f"source='{root / 'audio'}': no readable step_*.pt",
            "give a run's folder (the trainer's output folder), one of its checkpoint files, or a folder python -m "
            "tools.export wrote")
    demo = codec_checkpoint(tmp_path / "demo.pt", {"feature": "demo", "dim": 160}, 160)
    refused(lambda: rvq_tokenizer.load(demo), "was trained on demo", "rvq_tokenizer computes only features "
                                              "tools.extract wrote from audio")
    refused(lambda: rvq_tokenizer.load(3), "source is of type int: give the path of a run's folder")


def test_help_is_the_manual_for_each_public_call():
    from rvq_tokenizer.tokenizer import RVQTokenizer

    calls = [rvq_tokenizer.load, RVQTokenizer.encode, RVQTokenizer.encode_files, RVQTokenizer.features,
             RVQTokenizer.decode]
    for call in calls:
        doc = inspect.getdoc(call)
        assert all(f"\n{part}:\n" in doc for part in ("Args", "Returns", "Raises", "Example")), call.__name__
        args = doc[doc.index("\nArgs:\n"):doc.index("\nReturns:\n")]
        named = [p for p in inspect.signature(call).parameters if p != "self"]
        assert all(re.search(rf"^ +(\w+, )*{p}\b[,:]", args, re.M) for p in named), (call.__name__, named)
    assert "[batch, channels, samples]" in inspect.getdoc(RVQTokenizer) and "sample_rate" in inspect.getdoc(
        RVQTokenizer)


def test_the_readme_s_python_example_runs_as_written(door, monkeypatch):
    root, _, _, (a, *_) = door
    readme = (REPO / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert 'rvq_tokenizer.load("runs/mine")' in example
    monkeypatch.chdir(root)  # where runs/mine is, as in the README
    scope = {"wave": a, "sample_rate": RATE}
    exec(compile(example, "README.md", "exec"), scope)
    assert np.array_equal(scope["codes"], tokenized(root / "codes")[0])
    assert scope["features"].shape == (len(scope["codes"]), 160)


def shadowing_project(folder, package: str) -> None:
    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text("MINE = True\n")


@pytest.mark.parametrize("package", ["data", "errors"])
def test_a_project_s_own_package_before_the_checkout_is_named_by_the_import(tmp_path, package):
    shadowing_project(tmp_path, package)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", "import rvq_tokenizer"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: rvq_tokenizer needs the packages 'errors', 'data', 'models', 'training' of "
                           f"its checkout {REPO}") and f"'{package}' is {tmp_path / package}" in last, last
    assert f"sys.path.insert(0, '{REPO}')" in last and "rename your own package" in last


def test_a_project_s_own_tools_package_does_not_stand_in_the_way(door, tmp_path):
    _, run, _, _ = door
    shadowing_project(tmp_path, "tools")
    script = ("import numpy as np, rvq_tokenizer, tools\nassert tools.MINE\n"
              f"t = rvq_tokenizer.load({str(run)!r}, device='cpu')\n"
              "print(t.encode(np.sin(np.arange(8000) / 9).astype(np.float32), 16000).shape)")
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith(", 3)"), r.stderr[-2000:]
