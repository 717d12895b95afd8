"""rvq_tokenizer's library (a trained codec over audio, what the Python API and the commands share) in this process:
a codec read from a checkpoint file, a run or an export with one digest, the codes asked of it, the features it was
trained on refused when asked otherwise, what a w2v-bert shard records of its pipeline and goes on with, and a codec
over audio whose codes are those of its features' own codes."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.audio.features import SAMPLE_RATE
from data.audio.pass_plan import ALONE_RULE, PASS_RULE
from data.audio.sources import Utterances, WavesInMemory
from errors import PYTHON, BadInputError
from models.codes import code_frames
from rvq_tokenizer.audio_codec import audio_codec
from rvq_tokenizer.codec_files import codec_digest, is_export, load_codec, load_exported, recorded_digest
from rvq_tokenizer.codes_spec import CodesRequest, codes_spec, describe_codes
from rvq_tokenizer.pipeline_settings import default_pipeline, encoder_passes, resumed_pipeline
from rvq_tokenizer.trained_features import FeatureFlags, feature_maker, trained_features
from tests.audio_helpers import codec_checkpoint, tiny_w2v_bert, voice_like
from training.codec_passes import encode_in_batches

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")
FBANK = {"feature": "fbank", "dim": 160, "frame_rate_hz": 50, "sample_rate": SAMPLE_RATE, "front_end": "torch",
         "precision": "float32", "dtype": "float32"}
ASKED = CodesRequest(None, None, None, None, False)


@pytest.fixture(scope="module")
def fbank_codec(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    return codec_checkpoint(run / "checkpoints" / "step_00000007.pt", FBANK, 160, step=7, num_quantizers=3,
                            codebook_size=32)


def test_a_codec_is_one_digest_from_its_file_its_run_and_its_export(fbank_codec, tmp_path):
    from tools import export

    model, state, path = load_codec(fbank_codec)
    from_run = load_codec(fbank_codec.parent.parent)
    assert from_run[2] == path and codec_digest(from_run[1]["model"]) == codec_digest(state["model"])
    assert export.main([fbank_codec, tmp_path / "exported"]) == 0
    assert is_export(tmp_path / "exported") and not is_export(fbank_codec.parent)
    exported, exported_state, _ = load_exported(tmp_path / "exported")
    assert recorded_digest(exported_state) == recorded_digest(state) and exported_state["step"] == 7
    x = torch.randn(1, 20, 160)
    with torch.no_grad():
        assert torch.equal(exported.encode(x), model.encode(x))
    with pytest.raises(BadInputError, match="does not exist"):
        load_codec(tmp_path / "nowhere")
    with pytest.raises(BadInputError, match="no readable step_"):
        load_codec(tmp_path)


def test_the_codes_asked_are_checked_against_the_codec_and_recorded(fbank_codec):
    model, state, path = load_codec(fbank_codec)
    spec = codes_spec(CodesRequest(2, 3, None, 2, False), model, state, path, CPU)
    assert (spec.levels, spec.beam, spec.km, spec.dtype) == (2, 3, 2, np.dtype(np.int16))
    assert spec.bits_per_frame == 10.0 and spec.batch_frames == 2048  # 2 levels x 5 bits; the CPU's passes
    assert spec.settings["levels"] == 2 and spec.settings["codec_digest"] == recorded_digest(state)
    assert describe_codes(spec) == ("2 of 3 levels x 32 codes, downsample 1, int16, beam search 3 wide, level 2 also "
                                    "as NAME.km")
    for request, message in ((CodesRequest(4, None, None, None, False), "this codec has levels 1 to 3"),
                              (CodesRequest(2, None, None, 3, False), "--km 3: the codes have levels 1 to 2"),
                              (CodesRequest(None, 33, None, None, False), "the beam can be 32 wide at most")):
        with pytest.raises(BadInputError, match=message):
            codes_spec(request, model, state, path, CPU)


def test_features_other_than_the_codec_s_are_refused_naming_the_setting_as_the_caller_says_it(fbank_codec):
    _, state, path = load_codec(fbank_codec)
    assert trained_features(state, path, FeatureFlags(None, None, None, None)) == FBANK
    assert trained_features(state, path, FeatureFlags("fbank", None, None, None)) == FBANK
    with pytest.raises(BadInputError, match="Leave out --feature w2v-bert: the codec's are the default"):
        trained_features(state, path, FeatureFlags("w2v-bert", None, None, None))
    keyword = FeatureFlags("w2v-bert", None, None, None, asker=PYTHON)
    with pytest.raises(BadInputError, match="Leave out feature='w2v-bert'"):
        trained_features(state, path, keyword)
    with pytest.raises(BadInputError, match="tokenize computes only features tools.extract wrote from audio"):
        trained_features({"config": {"features": {"feature": "demo"}}}, path, FeatureFlags(None, None, None, None))


def test_a_w2v_bert_shard_records_its_pipeline_and_goes_on_with_it(tmp_path):
    w2v = tiny_w2v_bert(tmp_path / "w2v")
    features = {"feature": "w2v-bert", "dim": 32, "frame_rate_hz": 50, "sample_rate": SAMPLE_RATE,
                "front_end": "torch", "precision": "float32", "dtype": "float32", "checkpoint": str(w2v), "layer": 1,
                "max_chunk_seconds": 30.0}
    flags = FeatureFlags(None, None, None, None)
    new = default_pipeline("cpu")
    pipeline, before = resumed_pipeline(new, None, w2v_bert=True)
    assert (pipeline, before) == (new, False)
    fbank, encoder, made = feature_maker(features, flags, CPU, tmp_path / "codec.pt", before, compile=False)
    recorded = encoder_passes(encoder, pipeline, None, before)
    assert recorded["attention"] == encoder.attention and recorded["passes"] == ALONE_RULE  # a CPU's
    begun_batched = {**recorded, "passes": PASS_RULE}  # a shard begun before chunks went alone on a CPU
    assert encoder_passes(encoder, pipeline, begun_batched, before)["passes"] == PASS_RULE
    assert (recorded["batch_seconds"], recorded["commit_files"]) == (60.0, 1000) and "compile" not in recorded
    assert made["model"] and made["checkpoint"] == str(w2v.resolve())
    # a shard begun under --compile on goes on under it, and a flag that names the other is refused
    assert resumed_pipeline(new, {**recorded, "compile": "on"}, w2v_bert=True)[0].compile
    with pytest.raises(BadInputError, match="begun with --compile on"):
        resumed_pipeline(dataclasses.replace(new, switches_given=frozenset({"compile"})), {**recorded, "compile": "on"},
                         w2v_bert=True)
    # one begun before pass rules were recorded keeps its own passes, commits and transformers' attention
    old = {"batch_seconds": 20.0, "commit_files": 7, "commit_seconds": 30.0}
    kept, before = resumed_pipeline(new, old, w2v_bert=True)
    assert before and (kept.batch_seconds, kept.commit_files, kept.commit_seconds) == (20.0, 7, 30.0)
    assert encoder_passes(None, kept, old, before) == {}  # fbank features: nothing of w2v-BERT's to record
    assert resumed_pipeline(new, old, w2v_bert=False) == (new, False)


def test_a_codec_over_audio_gives_its_features_own_codes(fbank_codec):
    model, state, path = load_codec(fbank_codec)
    codec = audio_codec(model, state, path, ASKED, FeatureFlags(None, None, None, None), default_pipeline("cpu"), CPU,
                        recorded=None)
    assert codec.encoder is None and codec.passes == {} and codec.codes["features"] == FBANK
    waves = [voice_like(seconds, SAMPLE_RATE, seed).astype(np.float32) for seed, seconds in enumerate((0.7, 1.9, 1.2))]
    utterances = Utterances.listed(["a", "b", "c"], waves, WavesInMemory())
    on_host = codec.windows(utterances, num_workers=0, on_host=True)
    windows = on_host.windows(0)
    features = []
    for window in windows:
        window.ready()
        features += [item.features for item in window.files]
    windows.close()
    lengths = np.array([len(f) for f in features])
    want = encode_in_batches(model, SimpleNamespace(lengths=lengths, utterance=lambda i: features[i]), 3, 2048,
                             np.dtype(np.int16), model.config.beam_size)
    got = []
    windows = codec.windows(utterances, num_workers=0).windows(0)
    for window in windows:
        window.ready()
        frames, codes_back = codec.encode(window.files)
        got.append(codes_back())
        assert all(item.features is None for item in window.files)  # let go once encoded
    windows.close()
    assert np.array_equal(np.concatenate(got), want) and len(want) == code_frames(lengths, 1).sum()
