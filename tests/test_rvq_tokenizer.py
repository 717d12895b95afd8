"""rvq_tokenizer from Python: audio in memory to the codes tools.tokenize writes, bit for bit, and back to the
features tools.encode decode writes; a run, a checkpoint file and an export alike; bad input refused with one
ValueError and nothing written; one tokenizer shared by threads; the manual's data-loader example run as written."""
import json
import logging
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

import rvq_tokenizer
from rvq_tokenizer.tokenizer import audio_inputs
from tests.audio_helpers import chirp, random_codec, spoken, tiny_w2v_bert, voice_like
from tests.helpers import QUICK, REPO, TINY, trainer_in_process, tree
from tools import encode, export, extract, tokenize

SHARD = "train_0_1"
W2V = ["--feature", "w2v-bert", "--layer", 1, "--max_chunk_seconds", 1.0, "--device", "cpu"]
# (relpath, seconds, sample rate, channels): 17 files of 0.1-4.2 s, three formats, five rates, stereo among them
MIXED = [(f"{'sub/' if k % 5 == 4 else ''}u{k:02d}.{('wav', 'flac', 'ogg')[k % 3]}", seconds, rate,
          2 if k % 4 == 1 else 1) for k, (seconds, rate) in enumerate([
             (1.3, 16000), (2.6, 44100), (0.4, 22050), (4.2, 16000), (0.1, 48000), (3.1, 8000), (1.9, 16000),
             (0.7, 44100), (2.2, 22050), (3.6, 16000), (1.1, 48000), (0.25, 16000), (2.9, 44100), (1.6, 8000),
             (3.9, 22050), (0.55, 16000), (2.4, 48000)])]


def write_mixed(folder: Path) -> list[Path]:
    """The MIXED files under `folder`, in the order tools.extract lists the folder: espeak-ng's speech in every
    other file, chirps and voice-like tones in the rest."""
    for k, (rel, seconds, rate, channels) in enumerate(MIXED):
        x = (spoken(seconds, rate, seed=k) if k % 2 == 0 else chirp(seconds, rate) if k % 4 == 3
             else voice_like(seconds, rate, seed=k))
        if channels == 2:
            x = np.stack([x, 0.6 * x[::-1]], axis=1)
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        sf.write(folder / rel, x, rate, subtype="PCM_16" if rel.endswith(".wav") else None)
    return [folder / rel for rel in sorted(rel for rel, *_ in MIXED)]


def read_codes(folder: Path) -> tuple[np.ndarray, list[int], dict]:
    lengths = [int(n) for n in (folder / f"{SHARD}.codes.len").read_text().split()]
    meta = json.loads((folder / f"{SHARD}.codes.json").read_text())
    return np.load(folder / f"{SHARD}.codes.npy"), lengths, meta


def per_utterance(codes: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    return np.split(codes, np.cumsum(lengths)[:-1])


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """17 files of mixed lengths, rates and channels; their fbank and tiny-w2v-BERT dumps as tools.extract writes
    them by default; a run of the trainer on the fbank (downsample 2) and an untrained codec's checkpoint file for
    the w2v-BERT layer; each codec's export; and each tokenized by tools.tokenize (the 17 files, and the stereo
    44.1 kHz one alone), decoded by tools.encode decode."""
    root = tmp_path_factory.mktemp("rvq_tokenizer")
    m = SimpleNamespace(root=root, audio=root / "audio", one=root / "one", w2v=tiny_w2v_bert(root / "w2v_bert"))
    m.paths = write_mixed(m.audio)
    m.stereo = m.audio / "u01.flac"
    m.one.mkdir()
    (m.one / m.stereo.name).write_bytes(m.stereo.read_bytes())
    m.feats = {"fbank": root / "fbank_feats", "w2v": root / "w2v_feats"}
    assert extract.main([m.audio, "train", 1, 0, m.feats["fbank"]]) == 0
    assert extract.main([m.audio, "train", 1, 0, m.feats["w2v"], *W2V, "--checkpoint", m.w2v]) == 0
    run = trainer_in_process(["--data_dir", m.feats["fbank"], "--output_dir", root / "fbank_run", "--max_steps", 4,
                              *TINY, *QUICK, "--downsample", 2])
    assert run.returncode == 0, run.stderr[-3000:]
    m.codec = {"fbank": root / "fbank_run", "w2v": random_codec(root / "w2v_codec.pt", m.feats["w2v"])}
    for kind, codec in m.codec.items():
        assert tokenize.main([m.audio, "train", 1, 0, root / f"{kind}_codes", "--checkpoint", codec]) == 0
        assert tokenize.main([m.one, "train", 1, 0, root / f"{kind}_one", "--checkpoint", codec]) == 0
        assert encode.main(["decode", "--checkpoint", codec, "--codes_dir", root / f"{kind}_codes",
                            "--output_dir", root / f"{kind}_recon"]) == 0
        assert export.main([codec, root / f"{kind}_exported"]) == 0
    m.tokenizer = {kind: rvq_tokenizer.load(codec) for kind, codec in m.codec.items()}
    return m


def waves_of(paths, dtype="float64"):
    """Each file's samples [samples, channels] as soundfile reads them, and its rate."""
    read = [sf.read(str(p), dtype=dtype, always_2d=True) for p in paths]
    return [wave for wave, _ in read], [rate for _, rate in read]


KINDS = ["fbank", "w2v"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_encode_gives_the_codes_tools_tokenize_writes_for_17_files_and_for_one(made, kind):
    m, tokenizer = made, made.tokenizer[kind]
    want, lengths, meta = read_codes(m.root / f"{kind}_codes")
    assert len(lengths) == len(m.paths) == 17
    waves, rates = waves_of(m.paths)
    # as soundfile gives them, and as a torch user holds them: [channels, samples] float32 tensors (codes come back
    # as tensors on the tokenizer's device)
    for given in (waves, [torch.from_numpy(w.T.astype(np.float32)) for w in waves]):
        codes = tokenizer.encode(given, rates)
        tensors = isinstance(given[0], torch.Tensor)
        assert all(isinstance(c, torch.Tensor) == tensors for c in codes)
        codes = [c.cpu().numpy() if tensors else c for c in codes]
        assert [len(c) for c in codes] == lengths and all(c.dtype == want.dtype for c in codes)
        np.testing.assert_array_equal(np.concatenate(codes), want)
    np.testing.assert_array_equal(np.concatenate(tokenizer.encode_files(m.paths)), want)
    np.testing.assert_array_equal(np.concatenate(tokenizer.encode_files(m.paths, num_workers=0)), want)

    one, _, _ = read_codes(m.root / f"{kind}_one")  # one file: a shard of it alone
    (wave,), (rate,) = waves_of([m.stereo])
    np.testing.assert_array_equal(tokenizer.encode(wave, rate), one)
    np.testing.assert_array_equal(tokenizer.encode_files(m.stereo), one)
    # a 16-bit wav's samples as int16 PCM, as soundfile reads them as floats
    wav = next(p for p in m.paths if p.suffix == ".wav")
    (pcm,), (rate,) = waves_of([wav], dtype="int16")
    (floats,), _ = waves_of([wav])
    np.testing.assert_array_equal(tokenizer.encode(pcm, rate), tokenizer.encode(floats, rate))

    info = tokenizer.info  # what the shard records
    assert (info.levels, info.codebook_size, info.downsample, info.dtype, info.codec_digest, info.step) == \
        (meta["levels"], meta["codebook_size"], meta["downsample"], meta["dtype"], meta["codec_digest"], meta["step"])
    assert info.feature == meta["features"]["feature"] == ("fbank" if kind == "fbank" else "w2v-bert")
    assert info.frame_rate_hz == meta["features"]["frame_rate_hz"] / meta["downsample"]
    assert info.settings == {k: meta[k] for k in info.settings}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_features_are_what_tools_extract_writes(made, kind):
    m = made
    features = m.tokenizer[kind].features(*waves_of(m.paths))
    dump = np.load(m.feats[kind] / f"{SHARD}.npy")
    lengths = [int(n) for n in (m.feats[kind] / f"{SHARD}.len").read_text().split()]
    assert [len(f) for f in features] == lengths and all(f.dtype == dump.dtype for f in features)
    np.testing.assert_array_equal(np.concatenate(features), dump)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_decode_of_encode_is_what_tools_encode_decode_writes(made, kind):
    m, tokenizer = made, made.tokenizer[kind]
    codes = tokenizer.encode(*waves_of(m.paths))
    _, _, meta = read_codes(m.root / f"{kind}_codes")
    frames = meta["feature_frames"]
    recon = np.load(m.root / f"{kind}_recon" / f"{SHARD}.npy")
    decoded = tokenizer.decode(codes, frames)
    assert [len(d) for d in decoded] == frames
    np.testing.assert_array_equal(np.concatenate(decoded), recon)
    s = tokenizer.info.downsample  # without the frame count, downsample frames a code frame: the same first frames
    uncut = tokenizer.decode(codes[0])
    assert len(uncut) == len(codes[0]) * s and np.array_equal(uncut[: frames[0]], decoded[0])
    np.testing.assert_array_equal(tokenizer.decode(torch.from_numpy(codes[1][:, :1])),  # the first level alone
                                  tokenizer.decode(np.pad(codes[1][:, :1], ((0, 0), (0, 1)), constant_values=-1)))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_an_exported_folder_gives_the_codes_of_its_run(made, kind):
    m = made
    exported = rvq_tokenizer.load(m.root / f"{kind}_exported", w2v_bert=m.w2v)
    waves, rates = waves_of(m.paths)
    want = m.tokenizer[kind].encode(waves, rates)
    for got, codes in zip(exported.encode(waves, rates), want, strict=True):
        np.testing.assert_array_equal(got, codes)
    assert exported.info.codec_digest == m.tokenizer[kind].info.codec_digest
    assert exported.info.step == m.tokenizer[kind].info.step
    for got, features in zip(exported.decode(want), m.tokenizer[kind].decode(want), strict=True):
        np.testing.assert_array_equal(got, features)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bad_input_raises_one_value_error_naming_it_and_writes_nothing(made, tmp_path, monkeypatch):
    m, tokenizer = made, made.tokenizer["fbank"]
    monkeypatch.chdir(tmp_path)
    bad_file = m.root / "bad.wav"
    bad_file.write_text("not audio\n" * 20)
    other_w2v = tiny_w2v_bert(m.root / "other_w2v_bert", seed=1)
    old_export = m.root / "old_export"  # as exports were before they recorded the digest and the features
    old_export.mkdir()
    (old_export / "codec.safetensors").write_bytes((m.root / "w2v_exported" / "codec.safetensors").read_bytes())
    note = json.loads((m.root / "w2v_exported" / "codec.json").read_text())
    del note["checkpoint"]["codec_digest"], note["checkpoint"]["features"]
    (old_export / "codec.json").write_text(json.dumps(note))
    before = tree(m.root)
    second = np.zeros(16000, np.float32)
    codes = tokenizer.encode(second, 16000)
    cases = [
        (lambda: tokenizer.encode(np.zeros(0, np.float32), 16000), "audio is empty (shape (0,)): give at least 560"),
        (lambda: tokenizer.encode([second, np.zeros((2, 0))], 16000), "audio[1] is empty (shape (2, 0))"),
        (lambda: tokenizer.encode(np.zeros(300, np.float32), 16000),
         "audio is too short: 300 samples at 16 kHz, at least 560 give one frame (35 ms)"),
        (lambda: tokenizer.encode(np.zeros(200, np.float32), 8000), "audio is too short: 400 samples at 16 kHz"),
        (lambda: tokenizer.encode([second, np.r_[second, np.nan]], 16000),
         "audio[1] has NaN or Inf samples (the first at sample 16000): give finite samples"),
        (lambda: tokenizer.encode(torch.full((16000,), float("inf")), 16000), "audio has NaN or Inf samples"),
        (lambda: tokenizer.encode(second.astype(np.complex64), 16000),
         "audio has dtype complex64: give float samples in [-1, 1] (float16, float32 or float64) or integer PCM"),
        (lambda: tokenizer.encode(np.zeros(16000, np.int64), 16000), "audio has dtype int64"),
        (lambda: tokenizer.encode(second.tolist(), 16000), "audio[0] is a float: give a numpy array or a torch tensor"),
        (lambda: tokenizer.encode(second[None, None, None], 16000), "audio has shape (1, 1, 1, 16000): give one "
                                                                    "utterance [samples] or [samples, channels]"),
        (lambda: tokenizer.encode(second, 0), "sample_rate 0 of audio: give its sample rate in Hz, a positive number"),
        (lambda: tokenizer.encode([second, second], [16000, -8000]), "sample_rate -8000 of audio[1]"),
        (lambda: tokenizer.encode([second, second], [16000]), "sample_rate lists 1 rates for 2 waveform(s)"),
        (lambda: tokenizer.encode([], 16000), "audio is an empty list"),
        (lambda: tokenizer.features(second, float("nan")), "sample_rate nan of audio"),
        (lambda: tokenizer.encode_files([m.paths[0], bad_file], num_workers=0),
         f"paths[1] ({bad_file}): unreadable: Format not recognised. Nothing was encoded"),
        (lambda: tokenizer.encode_files(m.root / "gone.wav"), f"paths: {m.root / 'gone.wav'} is no file"),
        (lambda: tokenizer.decode(codes.astype(np.float32)), "codes has dtype float32: give integer codes"),
        (lambda: tokenizer.decode(np.zeros((5, 3), np.int16)), "codes has shape (5, 3): give [code frames, levels], "
                                                               "the codec's 2 levels or its first few"),
        (lambda: tokenizer.decode([codes, np.full_like(codes, 32)]),
         "codes[1] holds the code 32 at code frame 0, level 1: this codec's codes are 0 to 31 at each level"),
        (lambda: tokenizer.decode(np.full_like(codes, -2)), "codes holds the code -2"),
        (lambda: tokenizer.decode(codes, len(codes) * 2 + 1), f"frames {len(codes) * 2 + 1} for codes: its "
                                                              f"{len(codes)} code frames stand for"),
        (lambda: rvq_tokenizer.load(m.root / "nowhere"), "no such file or folder: give a run's folder"),
        (lambda: rvq_tokenizer.load(m.codec["w2v"], precision="bf16"), "Leave out precision='bf16'"),
        (lambda: rvq_tokenizer.load(m.codec["w2v"], w2v_bert=m.root / "gone"),
         f"{m.root / 'gone'} is not a folder here: give the model's folder with w2v_bert='DIR'"),
        (lambda: rvq_tokenizer.load(m.codec["w2v"], w2v_bert=other_w2v), f"w2v_bert='{other_w2v}' gives"),
        (lambda: rvq_tokenizer.load(m.codec["w2v"], precision="fp16"), "precision='fp16': give one of 'fp32', 'bf16'"),
        (lambda: rvq_tokenizer.load(old_export), f"{old_export} was exported before exports recorded the codec's "
                                                 f"digest and the features it was trained on: export it again with "
                                                 f"python -m tools.export {m.codec['w2v']} {old_export}"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert message in str(e.value), (message, str(e.value))
        assert "--" not in str(e.value), str(e.value)  # Python's words: a keyword or an argument, never a flag
    assert tree(m.root) == before and not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_threads_share_one_tokenizer(made):
    """Each thread encodes and decodes its own lists again and again, at once: each gets what it gets alone."""
    m, tokenizer = made, made.tokenizer["w2v"]
    waves, rates = waves_of(m.paths)
    lists = [(waves[:9], rates[:9]), (waves[9:], rates[9:])]
    alone = [tokenizer.encode(*given) for given in lists]
    decoded = [tokenizer.decode(codes) for codes in alone]
    results, errors = {}, []

    def work(k):
        try:
            for round in range(3):
                results[k, round] = tokenizer.encode(*lists[k]), tokenizer.decode(alone[k])
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors and len(results) == 6, errors
    for (k, _), (codes, features) in results.items():
        assert all(np.array_equal(a, b) for a, b in zip(codes, alone[k], strict=True))
        assert all(np.array_equal(a, b) for a, b in zip(features, decoded[k], strict=True))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_manuals_data_loader_example_runs_and_gives_tools_tokenizes_codes(made, tmp_path):
    m = made
    text = (REPO / "docs" / "audio-to-codes.md").read_text()
    section = text[text.index("## From Python"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for placeholder, value in (('"/data/audio"', repr(str(m.audio))), ('"*.flac"', repr("*.*")),
                               ('"runs/mine"', repr(str(m.codec["fbank"])))):
        assert example.count(placeholder) == 1, placeholder
        example = example.replace(placeholder, value)
    script = tmp_path / "example.py"
    script.write_text(example)
    scope = {"__name__": "example"}
    exec(compile(example, str(script), "exec"), scope)
    want, lengths, _ = read_codes(m.root / "fbank_codes")
    tsv = (m.root / "fbank_codes" / f"{SHARD}.codes.tsv").read_text().splitlines()
    by_file = dict(zip((str(m.audio / line.split("\t")[0]) for line in tsv[1:]), per_utterance(want, lengths)))
    assert len(scope["codes"]) == len(scope["paths"]) == 17
    for path, codes in zip(scope["paths"], scope["codes"]):
        np.testing.assert_array_equal(codes, by_file[path])


@pytest.mark.timeout(60)
def test_a_waveform_is_taken_as_tools_extract_takes_a_files_samples():
    """The channels are the shorter axis, averaged as soundfile's [samples, channels] are; int16 and int32 PCM are
    scaled as soundfile scales them; nothing but float and PCM is taken."""
    from data.audio.features import model_input

    rng = np.random.default_rng(0)
    stereo = (rng.standard_normal((3000, 2)) * 0.1).astype(np.float32)
    given = audio_inputs([stereo, stereo.T.copy(), torch.from_numpy(stereo.T)], [22050, 22050, 22050])
    (a, b, c), want = given.waves, model_input(stereo, 22050)
    assert given.keys == ["audio[0]", "audio[1]", "audio[2]"] and not given.single
    assert given.tensors == [False, False, True]
    assert np.array_equal(a, want) and np.array_equal(b, want) and np.array_equal(c, want)
    pcm = (rng.standard_normal(4000) * 3000).astype(np.int16)
    for ints in (pcm, pcm.astype(np.int32) << 16):
        given = audio_inputs(ints, 16000)
        (wave,) = given.waves
        assert given.single and wave.dtype == np.float32
        np.testing.assert_array_equal(wave, pcm.astype(np.float32) / 2 ** 15)
    assert audio_inputs(torch.zeros(1000, dtype=torch.bfloat16), 16000).waves[0].dtype == np.float32
    for bad in (np.zeros(1000, bool), np.zeros(1000, np.uint8), np.array(["a"] * 1000)):
        with pytest.raises(ValueError, match=f"audio has dtype {bad.dtype}: give float samples"):
            audio_inputs(bad, 16000)
