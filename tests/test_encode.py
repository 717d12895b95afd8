"""From audio to codes: extract -> train -> encode -> decode -> export -> report, as a user runs them."""
import json
import logging
import math
import re
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F


from data.stores import find_split
from rvq_tokenizer.codec_files import load_codec
from training.codec_passes import encode_batch
from tools import encode, export
from tests.audio_helpers import random_codec, run_module, write_corpus
from tests.helpers import TINY, env, events, run_python, run_trainer, write_fairseq

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


def read_codes(folder: Path, name: str):
    codes = np.load(folder / f"{name}.codes.npy")
    lengths = [int(n) for n in (folder / f"{name}.codes.len").read_text().split()]
    meta = json.loads((folder / f"{name}.codes.json").read_text())
    return codes, lengths, meta


def pad_to_multiple(features: torch.Tensor, multiple: int) -> torch.Tensor:
    """[T, D] -> [ceil(T / multiple) * multiple, D], the tail padded by repeating the last frame (as the tools pad
    an utterance before encoding it)."""
    missing = -features.shape[0] % multiple
    return torch.cat([features, features[-1:].expand(missing, -1)]) if missing else features


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Ten files of generated audio taken through every step by its command line."""
    root = tmp_path_factory.mktemp("pipeline")
    p = SimpleNamespace(audio=root / "audio", feats=root / "feats", run=root / "run", codes=root / "codes",
                        recon=root / "recon")
    p.relpaths = write_corpus(p.audio)
    steps = [
        ("tools.extract", p.audio, "train", 1, 0, p.feats, "--feature", "fbank"),
        ("tools.extract", p.audio, "valid", 1, 0, p.feats, "--feature", "fbank"),  # held out: the same audio
        None,  # the trainer
        ("tools.encode", "--checkpoint", p.run, "--data_dir", p.feats, "--split", "train", "--output_dir", p.codes),
        ("tools.encode", "decode", "--checkpoint", p.run, "--codes_dir", p.codes, "--split", "train",
         "--output_dir", p.recon),
    ]
    for step in steps:
        if step is None:
            # downsample 2 and a codebook projection: the paths where tails are padded and project_out exists
            r = run_trainer(["--data_dir", p.feats, "--output_dir", p.run, "--max_steps", 6, *TINY,
                             "--downsample", 2, "--codebook_dim", 8], timeout=150)
            assert r.returncode == 0, r.stderr[-3000:]
        else:
            r = run_module(*step)
            assert r.returncode == 0, r.stderr[-3000:]
            assert "finished successfully" in r.stderr
    p.model, p.state, p.checkpoint = load_codec(p.run)
    p.store = find_split(p.feats, "train")
    return p


def test_every_step_writes_its_documented_files(pipeline):
    p = pipeline
    assert len(p.store) == len(p.relpaths) == 10 and p.store.dim == 160
    codes, lengths, meta = read_codes(p.codes, "train_0_1")
    assert codes.dtype == np.int16 and codes.ndim == 2 and codes.shape == (sum(lengths), 2)
    assert 0 <= codes.min() and codes.max() < 32
    assert lengths == [math.ceil(n / 2) for n in p.store.lengths]  # downsample 2, tails padded
    assert meta["feature_frames"] == list(p.store.lengths) and meta["levels"] == 2 and meta["dtype"] == "int16"
    assert meta["step"] == 6 and meta["downsample"] == 2
    # codes map back to the audio files, in order
    lines = (p.codes / "train_0_1.codes.tsv").read_text().splitlines()
    assert lines[0] == str(p.audio.resolve()) and [line.split("\t")[0] for line in lines[1:]] == p.relpaths
    recon = find_split(p.recon, "train")  # decode writes a fairseq dump, cut back to each utterance's length
    assert list(recon.lengths) == list(p.store.lengths) and recon.dim == 160
    for folder in (p.feats, p.codes, p.recon):
        assert not list(folder.glob("*.tmp"))


def test_the_final_eval_scores_what_encode_and_decode_give(pipeline, tmp_path):
    """The trainer's last eval (whole held-out utterances, the codec's beam) gives the rel_mse of the held-out
    split encoded by tools.encode and decoded by tools.encode decode, as the quality tables score it; the evals
    during training say they score windows."""
    p = pipeline
    evals = events(p.run, "eval")
    assert evals[-1]["scored"] == "whole utterances" and evals[-1]["beam_size"] == 4
    assert all(e["scored"].endswith("-frame windows") for e in evals[:-1])
    assert encode.main(["--checkpoint", p.run, "--data_dir", p.feats, "--split", "valid",
                        "--output_dir", tmp_path / "codes"]) == 0
    assert encode.main(["decode", "--checkpoint", p.run, "--codes_dir", tmp_path / "codes", "--split", "valid",
                        "--output_dir", tmp_path / "recon"]) == 0
    valid, recon = find_split(p.feats, "valid"), find_split(tmp_path / "recon", "valid")
    x = np.concatenate([valid.utterance(i) for i in range(len(valid))]).astype(np.float64)
    x_hat = np.concatenate([recon.utterance(i) for i in range(len(recon))]).astype(np.float64)
    rel_mse = ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    assert evals[-1]["frames"] == len(x)
    assert evals[-1]["rel_mse"] == pytest.approx(rel_mse, rel=0.01)


def test_the_reports_command_gives_the_runs_configuration(pipeline, tmp_path):
    """report.md's command, read back by the trainer's own parser, is the configuration in config.json."""
    import re
    import shlex

    from tools import report
    from training.config import parse_args

    p = pipeline
    report.write_report(p.run, tmp_path)
    command = re.search(r"```bash\n(python rvq_seamless_gpu_cache_nccl.py .*)\n```", (tmp_path / "report.md").read_text())
    argv = shlex.split(command.group(1))[2:]
    assert "--multi_length_training" not in argv and "--downsample" in argv
    assert parse_args(argv).to_dict() == json.loads((p.run / "config.json").read_text())


def test_decode_of_encode_is_the_models_own_eval_reconstruction(pipeline):
    p = pipeline
    recon = find_split(p.recon, "train")
    odd = 0
    with torch.no_grad():
        for i in range(len(p.store)):
            x = torch.from_numpy(np.array(p.store.utterance(i)))
            odd += len(x) % 2
            want = p.model(pad_to_multiple(x, 2)[None], beam_size=4).reconstruction[0, : len(x)].numpy()
            np.testing.assert_array_equal(recon.utterance(i), want, err_msg=p.store.name(i))
    assert odd  # at least one utterance went through the padded tail


def test_fewer_levels_and_shards_are_slices_of_the_whole(pipeline, tmp_path):
    p = pipeline
    whole, whole_lengths, _ = read_codes(p.codes, "train_0_1")
    assert encode.main(["--checkpoint", p.checkpoint, "--data_dir", p.feats, "--output_dir", tmp_path,
                        "--num_quantizers", 1]) == 0
    one, lengths, meta = read_codes(tmp_path, "train_0_1")
    assert one.shape == (whole.shape[0], 1) and meta["levels"] == 1 and lengths == whole_lengths
    np.testing.assert_array_equal(one[:, 0], whole[:, 0])
    # one level decodes as the codec decodes it (the missing level adds nothing)
    assert encode.main(["decode", "--checkpoint", p.checkpoint, "--codes_dir", tmp_path, "--output_dir",
                        tmp_path / "recon"]) == 0
    first = torch.from_numpy(one[: lengths[0]].astype(np.int64))
    np.testing.assert_array_equal(find_split(tmp_path / "recon", "train").utterance(0),
                                  p.model.decode(first)[: p.store.lengths[0]].numpy())
    for rank in (0, 1):
        assert encode.main(["--checkpoint", p.run, "--data_dir", p.feats, "--output_dir", tmp_path / "shards",
                            "--nshard", 2, "--rank", rank]) == 0
    parts = [read_codes(tmp_path / "shards", f"train_{r}_2") for r in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([c for c, _, _ in parts]), whole)
    assert parts[0][1] + parts[1][1] == whole_lengths and parts[1][2]["first_utterance"] == 5


def test_the_batched_codes_are_the_one_by_one_codes(pipeline):
    p = pipeline
    whole, lengths, _ = read_codes(p.codes, "train_0_1")
    one_by_one = [encode_batch(p.model, [p.store.utterance(i)])[0] for i in range(len(p.store))]
    assert [len(c) for c in one_by_one] == lengths
    np.testing.assert_array_equal(whole, np.concatenate(one_by_one))


def test_codes_come_from_the_codecs_beam_search_unless_told_and_decode_no_worse(pipeline, tmp_path, caplog):
    p = pipeline
    beam, lengths, meta = read_codes(p.codes, "train_0_1")  # the pipeline's encode: no --beam_size
    assert p.model.config.beam_size == 4 and meta["beam_size"] == 4
    args = ["--checkpoint", p.run, "--data_dir", p.feats, "--output_dir", tmp_path, "--batch_frames", 512]
    assert encode.main([*args, "--beam_size", 1]) == 0
    greedy, greedy_lengths, meta = read_codes(tmp_path, "train_0_1")
    assert meta["beam_size"] == 1 and greedy_lengths == lengths and beam.shape == greedy.shape
    assert (beam != greedy).any()  # the search chose other codes somewhere
    one_by_one = [encode_batch(p.model, [p.store.utterance(i)], beam_size=1)[0] for i in range(len(p.store))]
    np.testing.assert_array_equal(greedy, np.concatenate(one_by_one))
    errors = {}
    x = torch.cat([pad_to_multiple(torch.from_numpy(np.array(p.store.utterance(i))), 2) for i in range(len(p.store))])
    for name, codes in (("greedy", greedy), ("beam", beam)):
        with torch.no_grad():
            errors[name] = float(((p.model.decode(torch.from_numpy(codes.astype(np.int64))) - x) ** 2).mean())
    assert errors["beam"] <= errors["greedy"] * 1.001, errors
    caplog.clear()  # the same shard asked for with the codec's beam: other settings, nothing overwritten
    assert encode.main(args) == 2
    assert "beam_size: 1 -> 4" in caplog.text
    np.testing.assert_array_equal(read_codes(tmp_path, "train_0_1")[0], greedy)


@pytest.mark.timeout(240)
def test_a_shard_killed_while_writing_resumes_to_the_codes_of_an_uninterrupted_run(pipeline, tmp_path, caplog):
    p = pipeline
    out = tmp_path / "codes"
    # chunks of about 100 feature frames: rank 1's five utterances (95, 150, 110, 120, 70 frames) make 4 chunks
    flags = ["--checkpoint", p.run, "--data_dir", p.feats, "--output_dir", out, "--nshard", 2, "--commit_frames", 100,
             "--batch_frames", 256]
    assert encode.main([*flags, "--rank", 0]) == 0
    command = ["-m", "tools.encode", *flags, "--rank", "1"]
    # SIGKILL once chunk 3 is written, uncommitted
    killed = run_python(command, timeout=120, env=env(RVQ_FAULT="kill:rank=1:step=3"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (out / "train_1_2.codes.npy").exists()
    committed = json.loads((out / "train_1_2.codes.progress").read_text())
    assert committed["done"] == 3  # utterances
    row = 2 * np.dtype(np.int16).itemsize  # 2 levels
    assert (out / "train_1_2.codes.npy.partial").stat().st_size > 128 + committed["rows"] * row

    # the partial shard is kept for the same settings only
    assert encode.main([*flags, "--rank", 1, "--num_quantizers", 1]) == 2
    assert "was begun with other settings (levels: 2 -> 1)" in caplog.text

    resumed = run_python(command, timeout=120, env=env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at utterance 3 of 5" in resumed.stderr and "bytes written after the last commit dropped" in \
        resumed.stderr
    assert not list(out.glob("*.partial")) and not list(out.glob("*.progress")) and not list(out.glob("*.tmp"))
    whole, whole_lengths, _ = read_codes(p.codes, "train_0_1")
    parts = [read_codes(out, f"train_{r}_2") for r in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([c for c, _, _ in parts]), whole)
    assert parts[0][1] + parts[1][1] == whole_lengths
    lines = (out / "train_1_2.codes.tsv").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines[1:]] == p.relpaths[5:]

    # every file as one uninterrupted run of rank 1 writes it
    assert encode.main([*flags[:5], tmp_path / "again", *flags[6:], "--rank", 1]) == 0
    for ext in (".codes.npy", ".codes.len", ".codes.json", ".codes.tsv"):
        assert (out / f"train_1_2{ext}").read_bytes() == (tmp_path / "again" / f"train_1_2{ext}").read_bytes(), ext

    # a finished shard: nothing to do with the same settings, an error with others, --overwrite starts again
    caplog.clear()
    before = (out / "train_1_2.codes.npy").stat().st_mtime_ns
    assert encode.main([*flags, "--rank", 1]) == 0 and "train_1_2 is complete" in caplog.text
    assert (out / "train_1_2.codes.npy").stat().st_mtime_ns == before
    assert encode.main([*flags, "--rank", 1, "--num_quantizers", 1]) == 2
    assert "train_1_2.codes.npy was written with other settings (levels: 2 -> 1)" in caplog.text
    assert encode.main([*flags, "--rank", 1, "--num_quantizers", 1, "--overwrite"]) == 0
    one, _, meta = read_codes(out, "train_1_2")
    assert meta["levels"] == 1 and one.shape[1] == 1 and not list(out.glob("*.partial"))


def test_encode_bad_input_exits_2_and_writes_nothing(pipeline, tmp_path, caplog):
    p = pipeline
    out = tmp_path / "out"
    cases = [
        (["--checkpoint", tmp_path / "nope.pt", "--data_dir", p.feats], "does not exist"),
        (["--checkpoint", p.run, "--data_dir", p.feats, "--num_quantizers", 3], "levels 1 to 2"),
        (["--checkpoint", p.run, "--data_dir", p.feats, "--split", "test"], "no split 'test'"),
        (["--checkpoint", p.run, "--data_dir", p.audio], "no split 'train'"),
    ]
    for args, message in cases:
        caplog.clear()
        assert encode.main([*args, "--output_dir", out]) == 2, args
        assert message in caplog.text, args
    assert not out.exists()


def test_decoding_a_split_encoded_in_shards_names_the_flags_that_decode_them(tmp_path, caplog):
    feats, codes, recon = tmp_path / "feats", tmp_path / "codes", tmp_path / "recon"
    write_fairseq(feats, "train", [40, 37, 50, 44, 21], dim=32)
    codec = random_codec(tmp_path / "codec.pt", feats)
    for rank in range(3):
        assert encode.main(["--checkpoint", codec, "--data_dir", feats, "--output_dir", codes, "--beam_size", 1,
                            "--nshard", 3, "--rank", rank]) == 0
    decode = ["decode", "--checkpoint", codec, "--codes_dir", codes, "--output_dir", recon]
    caplog.clear()
    assert encode.main(decode) == 2
    assert (f"--codes_dir {codes} holds split 'train' in 3 shards, not 1: decode each with --nshard 3 --rank R (R "
            "from 0 to 2)") in caplog.text and "run python -m tools.encode first" not in caplog.text
    assert not recon.exists()
    assert encode.main([*decode, "--nshard", 3, "--rank", 2]) == 0  # as it says
    assert [int(n) for n in (recon / "train_2_3.len").read_text().split()] == [44, 21]


def test_an_utterance_with_nan_or_inf_keeps_its_place_with_codes_of_minus_1_and_is_named(tmp_path, caplog):
    """Its codes are -1 (no code) at every frame and level, its lines in .codes.len and .km where they were, a
    warning and NAME.codes.skipped name it (its index in the split); the other utterances' codes are those of
    the same dump without the bad values, and decode reads the shard."""
    clean, feats = tmp_path / "clean", tmp_path / "feats"
    lengths = [40, 37, 50, 44, 21]
    for folder in (clean, feats):
        write_fairseq(folder, "train", lengths, dim=32)
    codec = random_codec(tmp_path / "codec.pt", clean, downsample=2)
    rows = np.load(feats / "train_0_1.npy")
    rows[40 + 5, 3], rows[127 + 43, 0] = np.nan, np.inf  # utterances 1 and 3
    np.save(feats / "train_0_1.npy", rows)
    flags = ["--checkpoint", codec, "--beam_size", 1, "--batch_frames", 256, "--km"]  # several utterances a pass
    assert encode.main([*flags, "--data_dir", clean, "--output_dir", tmp_path / "want"]) == 0
    caplog.clear()
    assert encode.main([*flags, "--data_dir", feats, "--output_dir", tmp_path / "codes"]) == 0
    codes, code_lengths, meta = read_codes(tmp_path / "codes", "train_0_1")
    want, _, _ = read_codes(tmp_path / "want", "train_0_1")
    assert code_lengths == [math.ceil(n / 2) for n in lengths] and meta["skipped"] == 2
    bad = np.repeat(np.isin(np.arange(5), [1, 3]), code_lengths)
    assert (codes[bad] == -1).all() and (codes[~bad] >= 0).all()
    np.testing.assert_array_equal(codes[~bad], want[~bad])
    km = (tmp_path / "codes" / "train_0_1.km").read_text().splitlines()
    assert km[1] == " ".join(["-1"] * code_lengths[1]) and len(km) == 5
    skipped = (tmp_path / "codes" / "train_0_1.codes.skipped").read_text().splitlines()
    assert [line.split("\t")[0] for line in skipped] == ["1", "3"]
    assert "train_0_1.npy utterance 1 (rows 40-77)" in skipped[0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "NaN or Inf" in r.getMessage()]
    assert len(warned) == 2 and "train_0_1.npy utterance 3" in warned[1] and "codes are -1" in warned[1]
    # a share of the split: the index is the split's; decode reads codes of -1 as no code
    assert encode.main([*flags, "--data_dir", feats, "--output_dir", tmp_path / "shards", "--nshard", 2, "--rank",
                        1]) == 0
    assert (tmp_path / "shards" / "train_1_2.codes.skipped").read_text().split("\t")[0] == "3"
    assert encode.main(["decode", "--checkpoint", codec, "--codes_dir", tmp_path / "codes", "--output_dir",
                        tmp_path / "recon"]) == 0
    assert np.isfinite(np.load(tmp_path / "recon" / "train_0_1.npy")).all()


def test_decode_says_the_reconstruction_error_against_the_features_it_was_encoded_from(tmp_path, caplog):
    """The .codes.json names the features its codes came from; decode scores its output against them (rel_mse as
    models/metrics.py defines it), and says why not when they are gone."""
    feats, codes, recon = tmp_path / "feats", tmp_path / "codes", tmp_path / "recon"
    write_fairseq(feats, "train", [40, 37, 50, 44, 21], dim=32)
    codec = random_codec(tmp_path / "codec.pt", feats, downsample=2)
    assert encode.main(["--checkpoint", codec, "--data_dir", feats, "--output_dir", codes, "--beam_size", 1,
                        "--nshard", 2, "--rank", 1]) == 0
    caplog.clear()
    assert encode.main(["decode", "--checkpoint", codec, "--codes_dir", codes, "--output_dir", recon, "--nshard", 2,
                        "--rank", 1]) == 0
    x = np.concatenate([find_split(feats, "train").utterance(i) for i in (2, 3, 4)]).astype(np.float64)
    x_hat = np.load(recon / "train_1_2.npy").astype(np.float64)
    rel_mse = ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    said = re.search(r"reconstruction of .*: rel_mse ([\d.]+), cosine [\d.]+ over (\d+) frames", caplog.text)
    assert said and float(said.group(1)) == pytest.approx(rel_mse, abs=1e-4) and int(said.group(2)) == len(x)
    shutil.rmtree(feats)
    caplog.clear()
    assert encode.main(["decode", "--checkpoint", codec, "--codes_dir", codes, "--output_dir", tmp_path / "again",
                        "--nshard", 2, "--rank", 1]) == 0
    assert "no reconstruction error: split 'train' of" in caplog.text and "rel_mse" not in caplog.text


def test_a_finished_shard_rerun_with_another_km_writes_that_level_without_encoding_again(tmp_path, caplog):
    """tools.encode --km 2 on a shard finished with --km: the files of a shard encoded with --km 2 from the start,
    its codes neither encoded nor written again; without --km, it keeps its .km and says so."""
    feats, codes = tmp_path / "feats", tmp_path / "codes"
    write_fairseq(feats, "train", [40, 37, 50], dim=32)
    args = ["--checkpoint", random_codec(tmp_path / "codec.pt", feats), "--data_dir", feats, "--beam_size", 1]
    assert encode.main([*args, "--output_dir", codes, "--km"]) == 0
    array = codes / "train_0_1.codes.npy"
    stamp = array.stat().st_mtime_ns
    caplog.clear()
    assert encode.main([*args, "--output_dir", codes]) == 0
    assert "train_0_1.km (level 1) is kept as it is: no --km asks for none" in caplog.text
    caplog.clear()
    assert encode.main([*args, "--output_dir", codes, "--km", 2]) == 0
    assert "level 2, from the finished codes (it held level 1)" in caplog.text and "encoded" not in caplog.text
    assert encode.main([*args, "--output_dir", tmp_path / "with 2", "--km", 2]) == 0
    assert read_files(codes) == read_files(tmp_path / "with 2") and array.stat().st_mtime_ns == stamp


def read_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def test_a_float16_dump_is_read_as_float32_by_a_codec_trained_on_float32_features_and_said_once(tmp_path, caplog):
    """tools.extract --dtype float16 of the features a codec was trained on in float32: the same features rounded,
    encoded (widened to float32) to the codes of those values stored in float32, and said once."""
    f16, f32 = tmp_path / "f16", tmp_path / "f32"
    write_fairseq(f16, "train", [40, 37, 50], dim=32, dtype=np.float16)
    write_fairseq(f32, "train", [40, 37, 50], dim=32)
    np.save(f32 / "train_0_1.npy", np.load(f16 / "train_0_1.npy").astype(np.float32))  # the same values
    note = {"feature": "fbank", "dim": 32, "frame_rate_hz": 50, "sample_rate": 16000, "front_end": "torch"}
    for folder, dtype in ((f16, "float16"), (f32, "float32")):
        (folder / "train_0_1.json").write_text(json.dumps({**note, "dtype": dtype}))
    codec = random_codec(tmp_path / "codec.pt", f32)
    assert encode.main(["--checkpoint", codec, "--data_dir", f32, "--output_dir", tmp_path / "want"]) == 0
    caplog.clear()
    assert encode.main(["--checkpoint", codec, "--data_dir", f16, "--output_dir", tmp_path / "codes"]) == 0
    said = [r.getMessage() for r in caplog.records if "stored as float16, trained on float32" in r.getMessage()]
    assert len(said) == 1 and "read as float32" in said[0]
    codes, _, meta = read_codes(tmp_path / "codes", "train_0_1")
    np.testing.assert_array_equal(codes, read_codes(tmp_path / "want", "train_0_1")[0])
    assert "stored as float16" in meta["feature_check"] and meta["features"]["dtype"] == "float16"


def test_encode_reads_utterance_files_directly_in_the_data_dir_as_the_trainer_does(pipeline, tmp_path):
    """A folder of [T, D] .npy files, the trainer's training split: encode's default --split train reads them."""
    p = pipeline
    loose = tmp_path / "loose"
    loose.mkdir()
    for i in range(len(p.store)):
        np.save(loose / f"u{i}.npy", np.asarray(p.store.utterance(i)))
    r = run_module("tools.encode", "--checkpoint", p.run, "--data_dir", loose, "--output_dir", tmp_path / "codes")
    assert r.returncode == 0, r.stderr[-3000:]
    codes, lengths, meta = read_codes(tmp_path / "codes", "train_0_1")
    expected, expected_lengths, _ = read_codes(p.codes, "train_0_1")
    assert lengths == expected_lengths and meta["feature_frames"] == list(p.store.lengths)
    np.testing.assert_array_equal(codes, expected)


def run_ops(ops: list, x: torch.Tensor, tensors: dict) -> torch.Tensor:
    """The exported op list in plain torch, on [batch, channels, time]."""
    for op in ops:
        if op["op"] in ("conv1d", "conv_transpose1d"):
            conv = F.conv1d if op["op"] == "conv1d" else F.conv_transpose1d
            bias = tensors[op["bias"]] if op["bias"] else None
            x = conv(x, tensors[op["weight"]], bias, stride=op["stride"], padding=op["padding"])
        elif op["op"] == "gelu":
            x = F.gelu(x)
        elif op["op"] == "residual":
            x = x + run_ops(op["body"], x, tensors)
        else:
            raise AssertionError(f"unknown op {op}")
    return x


def test_export_turns_codes_into_latents_and_features_with_plain_torch(pipeline, tmp_path):
    from safetensors.torch import load_file

    p = pipeline
    assert export.main([p.run, tmp_path]) == 0
    tensors = load_file(str(tmp_path / "codec.safetensors"))
    meta = json.loads((tmp_path / "codec.json").read_text())
    assert meta["feature"] == {"kind": "fbank", "dim": 160, "frame_rate_hz": 50, "sample_rate": 16000}
    assert (meta["levels"], meta["codebook_size"], meta["codebook_dim"], meta["downsample"]) == (2, 32, 8, 2)
    names = meta["tensors"]
    codebooks = tensors[names["codebooks"]]
    assert codebooks.shape == (2, 32, 8)

    codes = torch.from_numpy(np.load(p.codes / "train_0_1.codes.npy").astype(np.int64))
    summed = sum(codebooks[q][codes[:, q]] for q in range(meta["levels"]))
    out = names["project_out"]
    latent = F.linear(summed, tensors[out["weight"]], tensors[out["bias"]])
    with torch.no_grad():
        want = p.model.rvq.get_output_from_indices(codes[None])[0]
    torch.testing.assert_close(latent, want, rtol=1e-6, atol=1e-6)

    # latent -> features with the exported decoder, as tools.encode decode does it
    n = int((p.codes / "train_0_1.codes.len").read_text().split()[0])
    x = run_ops(meta["decoder"], latent[:n].T[None], tensors)[0].T
    features = x * tensors[names["feature_std"]] + tensors[names["feature_mean"]]
    torch.testing.assert_close(features, p.model.decode(codes[:n]), rtol=1e-5, atol=1e-5)

    # features -> codes with the exported encoder and nearest codebook rows: the codec's beam 1
    assert meta["beam_size"] == p.model.config.beam_size
    utterance = torch.from_numpy(np.array(p.store.utterance(0)))
    utterance = pad_to_multiple(utterance, 2)
    standard = (utterance - tensors[names["feature_mean"]]) / tensors[names["feature_std"]]
    residual = F.linear(run_ops(meta["encoder"], standard.T[None], tensors)[0].T,
                        tensors[names["project_in"]["weight"]], tensors[names["project_in"]["bias"]])
    found = []
    for q in range(meta["levels"]):
        index = torch.cdist(residual, codebooks[q]).argmin(-1)
        found.append(index)
        residual = residual - codebooks[q][index]
    agree = (torch.stack(found, -1) == p.model.encode(utterance, beam_size=1)).float().mean()
    assert agree >= 0.95  # nearest-row ties may fall either way between two float implementations


def test_the_exported_recipe_pads_and_cuts_as_encode_and_decode_do(tmp_path):
    """codec.json followed as it is written, without this repo, for utterances whose lengths are no multiple of the
    downsample: its tail padding gives tools.encode's code frames and codes, and its cut decode's features."""
    from safetensors.torch import load_file

    feats, codes, recon, exported = (tmp_path / n for n in ("feats", "codes", "recon", "exported"))
    lengths = [37, 42, 50, 29]
    write_fairseq(feats, "train", lengths, dim=32)
    codec = random_codec(tmp_path / "codec.pt", feats, downsample=4)
    assert encode.main(["--checkpoint", codec, "--data_dir", feats, "--output_dir", codes, "--beam_size", 1]) == 0
    assert encode.main(["decode", "--checkpoint", codec, "--codes_dir", codes, "--output_dir", recon]) == 0
    assert export.main([codec, exported]) == 0
    meta = json.loads((exported / "codec.json").read_text())
    tensors, names = load_file(str(exported / "codec.safetensors")), meta["tensors"]
    assert meta["downsample"] == 4 and names["project_in"] is None  # no projection: the latent is the codebooks'
    assert meta["tail_padding"] == "each utterance's tail is padded by repeating its last frame to a multiple of " \
                                   "downsample"
    assert "tail_padding" in meta["features_to_latent"] and "keeps the first T" in meta["latent_to_features"]
    assert meta["code_frames"] == "ceil(T / downsample) for an utterance of T frames"
    want, want_lengths, _ = read_codes(codes, "train_0_1")
    store, decoded = find_split(feats, "train"), find_split(recon, "train")
    mean, std, codebooks = (tensors[names[k]] for k in ("feature_mean", "feature_std", "codebooks"))
    found = []
    for i, n in enumerate(lengths):
        x = pad_to_multiple(torch.from_numpy(np.array(store.utterance(i))), meta["downsample"])
        residual = run_ops(meta["encoder"], ((x - mean) / std).T[None], tensors)[0].T
        levels = []
        for q in range(meta["levels"]):  # beam 1: the nearest row per level
            levels.append(torch.cdist(residual, codebooks[q]).argmin(-1))
            residual = residual - codebooks[q][levels[-1]]
        utterance = torch.stack(levels, -1)
        assert len(utterance) == math.ceil(n / 4) == want_lengths[i]
        found.append(utterance)
        given = torch.from_numpy(want[sum(want_lengths[:i]) : sum(want_lengths[: i + 1])].astype(np.int64))
        latent = sum(codebooks[q][given[:, q]] for q in range(meta["levels"]))  # tools.encode's codes, decoded
        features = (run_ops(meta["decoder"], latent.T[None], tensors)[0].T * std + mean)[:n]
        torch.testing.assert_close(features, torch.from_numpy(np.array(decoded.utterance(i))), rtol=1e-5, atol=1e-5)
    agree = (torch.cat(found).numpy() == want).mean()
    assert agree >= 0.95, agree  # nearest-row ties may fall either way between two float implementations


def test_report_of_the_run(pipeline):
    from tools import report

    assert report.main([pipeline.run]) == 0
    for name in (*report.PLOTS, "report.md"):
        assert (pipeline.run / "report" / name).stat().st_size > 0
    assert "eval rel_mse" in (pipeline.run / "report" / "report.md").read_text()


def test_a_file_that_is_no_checkpoint_exits_2_with_one_reason(tmp_path, caplog):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    assert export.main([tmp_path / "notes.pt", tmp_path / "out"]) == 2
    assert "could not be read: not a torch checkpoint" in caplog.text and "weights_only" not in caplog.text
    assert not (tmp_path / "out").exists()


def test_encode_refuses_zero_levels(pipeline, tmp_path, caplog):
    assert encode.main(["--checkpoint", pipeline.run, "--data_dir", pipeline.feats, "--num_quantizers", "0",
                        "--output_dir", tmp_path / "out"]) == 2
    assert "--num_quantizers 0: this codec has levels 1 to 2" in caplog.text
    assert not (tmp_path / "out").exists()


def test_encode_refuses_a_beam_wider_than_a_level_has_codes(pipeline, tmp_path, caplog):
    assert encode.main(["--checkpoint", pipeline.run, "--data_dir", pipeline.feats, "--beam_size", "33",
                        "--output_dir", tmp_path / "out"]) == 2
    assert "--beam_size 33: this codec has 32 codes a level" in caplog.text
    assert not (tmp_path / "out").exists()
