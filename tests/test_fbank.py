"""The fbank in torch (data/audio/fbank.py) is transformers' SeamlessM4TFeatureExtractor's within 1e-4, one utterance
or a batch; a dump records the front-end that made it, and tools.tokenize computes the one its codec was trained on."""
import json
import logging

import numpy as np
import pytest
import torch

from data.audio.features import SeamlessFbank
from data.audio.fbank import TorchFbank, feature_frames, kaldi_mel_filters, povey_window
from data.feature_settings import describe, dump_feature_settings, front_ends_differ, settings_differ
from errors import BadInputError
from rvq_tokenizer.trained_features import codec_front_end
from tests.audio_helpers import CORPUS, chirp, codec_checkpoint, voice_like, write_corpus
from tools import encode, extract, tokenize

pytestmark = pytest.mark.timeout(120)

SHARD = "train_0_1"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """As the front-end runs in a decoding worker: on a busy machine a team of threads waits on every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def extractor():
    from transformers import SeamlessM4TFeatureExtractor

    return SeamlessM4TFeatureExtractor()


def reference(extractor, wave: np.ndarray) -> np.ndarray:
    out = extractor(wave, sampling_rate=16000, return_tensors="np")
    return out["input_features"][0, : int(out["attention_mask"][0].sum())]


def speech_like(kind: str, samples: int, seed: int) -> np.ndarray:
    """16 kHz test signals: a voice, one with digital silence, one clipped loud, a pure chirp (its far bins lie below
    a float32 FFT's rounding), noise, a DC offset."""
    seconds = samples / 16000 + 0.01
    x = voice_like(seconds, 16000, seed=seed)[:samples]
    if kind == "silence":
        x[: samples // 5] = 0
        x[samples // 2: samples // 2 + samples // 4] = 0
    elif kind == "clipped":
        x = np.clip(10 * x, -1, 1)
    elif kind == "chirp":
        x = chirp(seconds, 16000)[:samples]
    elif kind == "noise":
        x = 0.05 * np.random.default_rng(seed).standard_normal(samples)
    elif kind == "dc":
        x = 0.5 + 0.2 * x
    return x.astype(np.float32)


KINDS = ("voice", "silence", "clipped", "chirp", "noise", "dc")
# 2, 3 and 4 fbank frames (the fewest samples, an odd count, an even count), then 1 s to 7 s
LENGTHS = (560, 720, 880, 16037, 52800, 113611)


def test_the_filters_and_window_are_the_extractors(extractor):
    np.testing.assert_array_equal(kaldi_mel_filters(), extractor.mel_filters)
    np.testing.assert_array_equal(povey_window(), extractor.window)


def test_torch_fbank_equals_the_extractor_within_1e4_with_its_valid_frames(extractor):
    fbank, worst = TorchFbank(), {}
    for k, kind in enumerate(KINDS):
        for samples in LENGTHS:
            wave = speech_like(kind, samples, seed=k)
            got, want = fbank(wave), reference(extractor, wave)
            assert got.dtype == torch.float32 and got.shape == (feature_frames(samples), 160) == want.shape
            worst[kind, samples] = float(np.abs(got.numpy() - want).max())
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert [feature_frames(n) for n in LENGTHS[:3]] == [1, 1, 2]


def test_a_batch_gives_each_row_its_own_features(extractor):
    fbank = TorchFbank()
    waves = [speech_like(kind, n, seed=3) for kind, n in zip(KINDS, (560, 9000, 723, 16037, 4481, 30000))]
    lengths = torch.tensor([len(w) for w in waves])
    padded = torch.zeros(len(waves), int(lengths.max()))
    for row, wave in enumerate(waves):
        padded[row, : len(wave)] = torch.from_numpy(wave)
        padded[row, len(wave):] = 0.5  # what lies past a row's length is not its audio
    features, frames = fbank.batch(padded, lengths)
    assert frames.tolist() == [feature_frames(len(w)) for w in waves] and features.shape[1] == max(frames)
    for row, wave in enumerate(waves):
        np.testing.assert_allclose(features[row, : frames[row]], fbank(wave), rtol=0, atol=1e-5)
        np.testing.assert_allclose(features[row, : frames[row]], reference(extractor, wave), rtol=0, atol=1e-4)
        assert not features[row, frames[row]:].any()


def test_both_front_ends_behind_seamless_fbank_and_a_preprocessor_the_torch_one_cannot_follow(extractor, tmp_path):
    wave = speech_like("voice", 24000, seed=5)
    torch_fbank, transformers_fbank = SeamlessFbank(None, "torch"), SeamlessFbank(None, "transformers")
    assert torch_fbank.dim == transformers_fbank.dim == 160
    np.testing.assert_array_equal(transformers_fbank(wave), reference(extractor, wave))
    got = torch_fbank(wave)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference(extractor, wave), rtol=0, atol=1e-4)
    w2v_bert_2 = {"feature_extractor_type": "SeamlessM4TFeatureExtractor", "feature_size": 80, "num_mel_bins": 80,
                  "padding_value": 1, "sampling_rate": 16000, "stride": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(w2v_bert_2))
    assert SeamlessFbank(tmp_path, "torch").dim == 160
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**w2v_bert_2, "stride": 3}))
    with pytest.raises(BadInputError, match="stride: 3.*--front_end transformers"):
        SeamlessFbank(tmp_path, "torch")


def test_the_front_end_is_recorded_shown_and_not_a_difference(tmp_path):
    torch_note = {"feature": "fbank", "dim": 160, "front_end": "torch", "dtype": "float32"}
    before = {k: v for k, v in torch_note.items() if k != "front_end"}
    assert settings_differ(before, torch_note) == "" and settings_differ(torch_note, {**torch_note, "dim": 80})
    assert front_ends_differ(before, torch_note) == "front-end: transformers -> torch"
    assert front_ends_differ(before, {**before, "front_end": "transformers"}) == ""
    assert describe(torch_note) == "fbank (160-d, stored as float32, torch front-end)"
    assert describe(before) == "fbank (160-d, stored as float32)"
    for rank, note in enumerate((before, torch_note)):  # a split of a shard from before and one of the torch front-end
        (tmp_path / f"train_{rank}_2.json").write_text(json.dumps(note))
        np.save(tmp_path / f"train_{rank}_2.npy", np.zeros((1, 160), np.float32))
    mixed = dump_feature_settings(tmp_path, "train")
    assert mixed == {**torch_note, "front_end": "torch+transformers"}
    assert codec_front_end(mixed) == "transformers" and codec_front_end(before) == "transformers"
    (tmp_path / "train_1_2.json").write_text(json.dumps({**torch_note, "dtype": "float16"}))
    assert dump_feature_settings(tmp_path, "train")["feature"] == "mixed"


def utterances(folder, name=SHARD) -> list[np.ndarray]:
    lengths = [int(n) for n in (folder / f"{name}.len").read_text().split()]
    return np.split(np.load(folder / f"{name}.npy"), np.cumsum(lengths)[:-1])


def codec_for(path, features: dict):
    """An untrained codec of the fbank's dim whose checkpoint records `features`, as the trainer records a dump's."""
    return codec_checkpoint(path, features, 160)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A corpus of three files, extracted with each front-end."""
    root = tmp_path_factory.mktemp("front_ends")
    write_corpus(root / "audio", CORPUS[:3])
    for front_end in ("torch", "transformers"):
        flags = ["--front_end", front_end] if front_end == "transformers" else []  # torch: the default
        assert extract.main([root / "audio", "train", 1, 0, root / front_end, "--num_workers", 0, *flags]) == 0
    return root


def test_a_dump_records_its_front_end_and_both_give_the_same_features(dumps):
    for front_end in ("torch", "transformers"):
        assert json.loads((dumps / front_end / f"{SHARD}.json").read_text())["front_end"] == front_end
        assert dump_feature_settings(dumps / front_end, "train")["front_end"] == front_end
    for a, b in zip(utterances(dumps / "torch"), utterances(dumps / "transformers"), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_a_shard_begun_before_front_ends_were_recorded_goes_on_with_its_own(dumps, tmp_path, monkeypatch, caplog):
    out = tmp_path / "legacy"
    real, calls = SeamlessFbank.__call__, []

    def crashing(self, wave):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(self, wave)

    monkeypatch.setattr(SeamlessFbank, "__call__", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        extract.main([dumps / "audio", "train", 1, 0, out, "--num_workers", 0, "--commit_files", 1,
                      "--front_end", "transformers"])
    monkeypatch.undo()
    progress = json.loads((out / f"{SHARD}.progress").read_text())
    assert progress["done"] == 1
    del progress["settings"]["front_end"]  # as the tool wrote it before
    (out / f"{SHARD}.progress").write_text(json.dumps(progress))
    caplog.set_level(logging.INFO)
    assert extract.main([dumps / "audio", "train", 1, 0, out, "--num_workers", 0, "--commit_files", 1]) == 0
    assert "resuming at file 1 of 3" in caplog.text and "fbank front-end: transformers (the shard's" in caplog.text
    assert "front_end" not in json.loads((out / f"{SHARD}.json").read_text())  # as it began: none means transformers
    assert (out / f"{SHARD}.npy").read_bytes() == (dumps / "transformers" / f"{SHARD}.npy").read_bytes()
    caplog.clear()
    assert extract.main([dumps / "audio", "train", 1, 0, out, "--num_workers", 0]) == 0  # found complete
    assert "is complete" in caplog.text


def test_tokenize_computes_the_codecs_front_end_and_encode_takes_either(dumps, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trained_on = {"torch": dump_feature_settings(dumps / "torch", "train"),
                  "transformers": {k: v for k, v in dump_feature_settings(dumps / "transformers", "train").items()
                                   if k != "front_end"}}  # a checkpoint from before front-ends were recorded
    for front_end, features in trained_on.items():
        codec = codec_for(tmp_path / f"{front_end}.pt", features)
        caplog.clear()
        assert tokenize.main([dumps / "audio", "train", 1, 0, tmp_path / f"tokenized_{front_end}", "--checkpoint",
                              codec, "--num_workers", 0]) == 0
        assert f"fbank front-end: {front_end} (the codec's features: " in caplog.text
        meta = json.loads((tmp_path / f"tokenized_{front_end}" / f"{SHARD}.codes.json").read_text())
        assert meta["features"].get("front_end") == features.get("front_end")
        assert encode.main(["--checkpoint", codec, "--data_dir", dumps / front_end, "--output_dir",
                            tmp_path / f"encoded_{front_end}"]) == 0
        assert ((tmp_path / f"tokenized_{front_end}" / f"{SHARD}.codes.npy").read_bytes()
                == (tmp_path / f"encoded_{front_end}" / f"{SHARD}.codes.npy").read_bytes())
    # a codec of the extractor's features encodes a dump of the torch front-end: the same features
    assert encode.main(["--checkpoint", tmp_path / "transformers.pt", "--data_dir", dumps / "torch", "--output_dir",
                        tmp_path / "encoded_across"]) == 0
