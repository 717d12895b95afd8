"""tools.evaluate: PNMI and purities as fairseq's measure_teacher_quality defines them, the three alignment formats
read to the same frame labels, the k-means baseline, and bad alignments refused (exit 2, nothing written)."""
import errno
import io
import json
import logging
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.alignments import SILENCE, labels_at_code_rate, read_alignments, read_textgrid_tiers
from data.feature_settings import dump_feature_settings
from models.codec import CodecConfig, RVQCodec
from models.kmeans import fit_kmeans, nearest_centroids
from models.unit_quality import joint_units, phone_information, unit_quality
from tests.helpers import env, run_python, write_fairseq
from tools import encode, evaluate

RATE = 50  # feature frames per second
# each utterance: (name, [(phone, first frame, frames)]); silence where no phone is given
UTTERANCES = [("spk1_a", [("h", 0, 3), ("e", 3, 4), ("l", 9, 5)]),
              ("spk1_b", [("o", 1, 6), ("w", 7, 3)]),
              ("spk2_c", [("e", 0, 2), ("r", 2, 4), ("l", 6, 2), ("d", 8, 4), ("h", 12, 3)])]
LENGTHS = [16, 11, 15]


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


def reference(phones, units) -> dict:
    """PNMI and the purities straight from their definitions, with dicts and loops."""
    n = len(phones)
    joint, by_phone, by_unit = Counter(zip(phones, units)), Counter(phones), Counter(units)
    mi = sum(c / n * math.log((c / n) / ((by_phone[y] / n) * (by_unit[z] / n))) for (y, z), c in joint.items())
    h = -sum(c / n * math.log(c / n) for c in by_phone.values())
    phone_purity = sum(max(c for (y, z2), c in joint.items() if z2 == z) for z in by_unit) / n
    cluster_purity = sum(max(c for (y2, z), c in joint.items() if y2 == y) for y in by_phone) / n
    return {"pnmi": mi / h, "phone_purity": phone_purity, "cluster_purity": cluster_purity}


@pytest.mark.timeout(30)
def test_pnmi_and_purities_equal_a_count_by_hand():
    rng = np.random.default_rng(0)
    phones = rng.choice(["a", "b", "c", "d", "sil"], size=400, p=[0.3, 0.25, 0.2, 0.15, 0.1])
    codes = np.stack([rng.integers(0, 6, 400), rng.integers(0, 5, 400), rng.integers(0, 7, 400)], 1)
    codes[:, 0] = np.where(rng.random(400) < 0.6, np.searchsorted(["a", "b", "c", "d", "sil"], phones), codes[:, 0])
    measured = phone_information(phones, codes)
    for k in range(1, 4):
        tuples = [tuple(row) for row in codes[:, :k].tolist()]
        for key, value in reference(list(phones), codes[:, k - 1].tolist()).items():
            assert measured[k - 1][key] == pytest.approx(value, rel=1e-12, abs=1e-12)
        for key, value in reference(list(phones), tuples).items():
            assert measured[k - 1]["joint_" + key] == pytest.approx(value, rel=1e-12, abs=1e-12)
        # the joint unit is the tuple of the first k levels: as many units as distinct tuples, one per tuple
        units = joint_units(codes, k)
        assert len(set(units.tolist())) == len(set(tuples)) == len(set(zip(units.tolist(), tuples)))
    # known answers: codes that are the phones carry all of it; one code carries none
    same = unit_quality(phones, np.searchsorted(["a", "b", "c", "d", "sil"], phones))
    assert same == pytest.approx({"pnmi": 1.0, "phone_purity": 1.0, "cluster_purity": 1.0})
    constant = unit_quality(phones, np.zeros(400, np.int64))
    assert constant["pnmi"] == 0.0 and constant["cluster_purity"] == 1.0
    assert constant["phone_purity"] == pytest.approx(Counter(phones.tolist()).most_common(1)[0][1] / 400)
    assert unit_quality(np.zeros(5), np.arange(5))["pnmi"] is None  # one phone: no entropy to explain


def frame_labels(phones, frames) -> list[str]:
    labels = [SILENCE] * frames
    for phone, first, count in phones:
        labels[first : first + count] = [phone] * count
    return labels


def textgrid(phones, frames, short: bool) -> str:
    """A TextGrid of an utterance as the Montreal Forced Aligner writes it (silence as empty intervals), with a
    words tier before the phones."""
    labels = frame_labels(phones, frames)
    edges = [0] + [i for i in range(1, frames) if labels[i] != labels[i - 1]] + [frames]
    intervals = [(a / RATE, b / RATE, "" if labels[a] == SILENCE else labels[a]) for a, b in zip(edges, edges[1:])]
    xmax = frames / RATE
    if short:
        body = [f'"IntervalTier"\n"words"\n0\n{xmax}\n1\n0\n{xmax}\n"hello ""there"""',
                f'"IntervalTier"\n"phones"\n0\n{xmax}\n{len(intervals)}\n'
                + "\n".join(f'{a}\n{b}\n"{t}"' for a, b, t in intervals)]
        return f'File type = "ooTextFile"\nObject class = "TextGrid"\n\n0\n{xmax}\n<exists>\n2\n' + "\n".join(body) + "\n"
    items = [f'    item [1]:\n        class = "IntervalTier"\n        name = "words"\n        xmin = 0\n'
             f'        xmax = {xmax}\n        intervals: size = 1\n        intervals [1]:\n            xmin = 0\n'
             f'            xmax = {xmax}\n            text = "hello [2]"\n']
    rows = "".join(f"        intervals [{j}]:\n            xmin = {a}\n            xmax = {b}\n            text = \"{t}\"\n"
                   for j, (a, b, t) in enumerate(intervals, 1))
    items.append(f'    item [2]:\n        class = "IntervalTier"\n        name = "phones"\n        xmin = 0\n'
                 f'        xmax = {xmax}\n        intervals: size = {len(intervals)}\n' + rows)
    return (f'File type = "ooTextFile"\nObject class = "TextGrid"\n\nxmin = 0\nxmax = {xmax}\ntiers? <exists>\n'
            f'size = 2\nitem []:\n' + "".join(items))


def ctm(utterances) -> str:
    """CTM lines of the phones alone (silence left out, as aligners' CTMs do), in seconds."""
    lines = [";; utt channel start duration phone"]
    for name, phones in utterances:
        lines += [f"{name} 1 {first / RATE:.2f} {count / RATE:.2f} {phone}" for phone, first, count in phones]
    return "\n".join(lines) + "\n"


def write_dump(folder: Path, split: str, lengths, names, seed: int) -> list[np.ndarray]:
    """A fairseq dump of 16-d frames with the .tsv manifest tools.extract writes beside it (names: audio stems)."""
    utts = write_fairseq(folder, split, lengths, seed=seed)
    (folder / f"{split}_0_1.tsv").write_text(
        f"{folder}/audio\n" + "".join(f"{name}.wav\t{n * 320}\n" for name, n in zip(names, lengths)))
    return utts


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny dump (train and valid), an untrained codec of downsample 2 for it, and the valid split's phones in
    the three formats."""
    root = tmp_path_factory.mktemp("evaluate")
    d = SimpleNamespace(root=root, feats=root / "feats", names=[name for name, _ in UTTERANCES])
    write_dump(d.feats, "train", [40, 60, 50, 70] * 8, [f"t{i}" for i in range(32)], seed=0)
    d.valid = write_dump(d.feats, "valid", LENGTHS, d.names, seed=1)
    d.labels = [frame_labels(phones, n) for (_, phones), n in zip(UTTERANCES, LENGTHS)]
    d.phn = root / "valid.phn"
    d.phn.write_text("".join(" ".join(labels) + "\n" for labels in d.labels))
    d.textgrids = root / "textgrids"
    d.textgrids.mkdir()
    for j, ((name, phones), n) in enumerate(zip(UTTERANCES, LENGTHS)):
        (d.textgrids / f"{name}.TextGrid").write_text(textgrid(phones, n, short=j == 1))
    d.ctm = root / "valid.ctm"
    d.ctm.write_text(ctm(UTTERANCES))
    torch.manual_seed(0)
    config = CodecConfig(feature_dim=16, latent_dim=16, num_quantizers=2, codebook_size=16, kmeans_init=False,
                         downsample=2)
    d.checkpoint = root / "codec.pt"
    torch.save({"model": RVQCodec(config).state_dict(), "codec": config.to_dict(), "step": 0,
                "config": {"features": dump_feature_settings(d.feats, "train")}}, d.checkpoint)
    return d


@pytest.mark.timeout(30)
def test_each_alignment_format_reads_to_the_same_frame_labels(data):
    d = data
    assert set(read_textgrid_tiers(d.textgrids / "spk1_a.TextGrid")) == {"words", "phones"}
    assert read_textgrid_tiers(d.textgrids / "spk1_b.TextGrid")["words"][1][0][2] == 'hello "there"'  # short format
    read = {}
    for path in (d.phn, d.textgrids, d.ctm):
        found = read_alignments(path, np.array(LENGTHS), d.names, RATE)
        read[path.name] = [[found.phones[i] for i in labels] for labels in found.labels]
    assert read["valid.phn"] == read["textgrids"] == read["valid.ctm"] == d.labels
    # one frame more or fewer is fitted (cut, or the last label repeated); TextGrid in UTF-16 as Praat saves it
    one_off = d.root / "one_off.phn"
    one_off.write_text("".join(" ".join(labels[: len(labels) - (j == 0)] + ["x"] * (j == 1)) + "\n"
                               for j, labels in enumerate(d.labels)))
    found = read_alignments(one_off, np.array(LENGTHS), None, RATE)
    assert [[found.phones[i] for i in labels] for labels in found.labels] == [
        d.labels[0][:-1] + d.labels[0][-1:], d.labels[1], d.labels[2]]
    utf16 = d.root / "utf16"
    utf16.mkdir()
    for name in d.names:
        (utf16 / f"{name}.TextGrid").write_bytes((d.textgrids / f"{name}.TextGrid").read_text().encode("utf-16"))
    found = read_alignments(utf16, np.array(LENGTHS), d.names, RATE)
    assert [[found.phones[i] for i in labels] for labels in found.labels] == d.labels


@pytest.mark.timeout(10)
def test_code_frames_take_the_label_of_their_first_feature_frame():
    labels = np.array([0, 0, 1, 1, 1, 2, 2])
    assert labels_at_code_rate(labels, 1).tolist() == labels.tolist()
    assert labels_at_code_rate(labels, 2).tolist() == [0, 1, 1, 2]  # ceil(7 / 2) code frames
    assert labels_at_code_rate(labels, 4).tolist() == [0, 1]


@pytest.mark.timeout(30)
def test_kmeans_finds_separated_clusters_and_is_seeded():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((8, 4)) * 20
    truth = rng.integers(0, 8, 2000)
    samples = torch.from_numpy(centres[truth] + rng.standard_normal((2000, 4))).float()
    means = fit_kmeans(samples, 8, seed=3)
    assert torch.equal(means, fit_kmeans(samples, 8, seed=3))
    assert unit_quality(truth, nearest_centroids(samples, means).numpy())["pnmi"] == pytest.approx(1.0)


def run_evaluate(d, *flags):
    return evaluate.main(["--checkpoint", d.checkpoint, "--data_dir", d.feats, "--split", "valid", *flags])


@pytest.mark.timeout(90)
def test_the_json_holds_every_figure_and_the_phone_measures_of_the_codes_encode_writes(data, tmp_path, capsys):
    d = data
    out = tmp_path / "eval.json"
    assert run_evaluate(d, "--alignments", d.textgrids, "--json", out) == 0
    result = json.loads(out.read_text())
    assert {"rel_mse", "cosine", "bits_per_frame", "levels", "frames", "utterances"} <= set(result)
    assert result["frames"] == sum(LENGTHS) and result["bits_per_frame"] == 2 * 4 / 2 and "baseline" not in result
    assert [level["level"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert {"usage", "perplexity", "pnmi", "phone_purity", "cluster_purity", "joint_pnmi"} <= set(level)
    printed = capsys.readouterr().out
    assert "rel_mse" in printed and "pnmi" in printed
    # the same figures from the codes tools.encode writes, each code frame labelled by its first feature frame
    assert encode.main(["--checkpoint", d.checkpoint, "--data_dir", d.feats, "--split", "valid",
                        "--output_dir", tmp_path / "codes"]) == 0
    codes = np.load(tmp_path / "codes" / "valid_0_1.codes.npy")
    phones = np.concatenate([np.array(labels)[::2] for labels in d.labels])
    assert len(phones) == len(codes) == sum(math.ceil(n / 2) for n in LENGTHS)
    for level, expected in zip(result["levels"], phone_information(phones, codes)):
        assert {k: level[k] for k in expected} == pytest.approx(expected)
    # without alignments: no phone keys; --num_quantizers keeps the first levels
    assert run_evaluate(d, "--json", out, "--num_quantizers", 1) == 0
    fewer = json.loads(out.read_text())
    assert "pnmi" not in fewer["levels"][0] and len(fewer["levels"]) == 1 and fewer["bits_per_frame"] == 2.0
    assert fewer["levels"][0]["usage"] == result["levels"][0]["usage"]  # level 1's codes alike


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_kmeans_baseline_is_scored_beside_the_codec(data, tmp_path):
    d = data
    out = tmp_path / "eval.json"
    r = run_python(["-m", "tools.evaluate", "--checkpoint", d.checkpoint, "--data_dir", d.feats, "--split", "valid",
                    "--alignments", d.ctm, "--baseline", "kmeans", "--json", out], timeout=80, env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    baseline = json.loads(out.read_text())["baseline"]
    assert baseline["method"] == "kmeans" and baseline["clusters"] == 16 and baseline["split"] == "train"
    assert baseline["train_frames"] == 32 * 55  # the whole training split: fewer frames than the bound
    assert {"usage", "perplexity", "rel_mse", "pnmi", "phone_purity", "cluster_purity"} <= set(baseline)
    assert 0 < baseline["rel_mse"] < 1 and 0 <= baseline["pnmi"] <= 1
    assert "k-means" in r.stdout and "finished successfully" in r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["missing line", "missing TextGrid", "missing in CTM", "3 frames short",
                                  "double rate", "CTM past the end"])
def test_bad_alignments_exit_2_naming_the_utterance_and_write_nothing(data, tmp_path, caplog, case):
    d = data
    bad = tmp_path / ("bad.ctm" if "CTM" in case else "bad.phn")
    lines = [" ".join(labels) for labels in d.labels]
    named = d.names[1]
    if case == "missing line":
        bad.write_text("\n".join(lines[:1]) + "\n")
    elif case == "missing TextGrid":
        bad = tmp_path / "grids"
        bad.mkdir()
        for name in d.names[:1] + d.names[2:]:
            (bad / f"{name}.TextGrid").write_text((d.textgrids / f"{name}.TextGrid").read_text())
    elif case == "missing in CTM":
        bad.write_text(ctm(UTTERANCES[:1] + UTTERANCES[2:]))
    elif case == "3 frames short":
        bad.write_text("\n".join([lines[0], " ".join(d.labels[1][:-3]), lines[2]]) + "\n")
    elif case == "double rate":
        bad.write_text("\n".join([lines[0], " ".join(x for label in d.labels[1] for x in (label, label)), lines[2]])
                       + "\n")
    else:
        bad.write_text(ctm([UTTERANCES[0], (named, [("o", 9, 6)]), UTTERANCES[2]]))  # ends at frame 15 of 11
    out = tmp_path / "eval.json"
    assert run_evaluate(d, "--alignments", bad, "--baseline", "kmeans", "--json", out) == 2
    assert "utterance 1 (" in caplog.text and (named in caplog.text or "valid_0_1.npy utterance 1" in caplog.text)
    if case == "double rate":
        assert "22 labels for 11 feature frames" in caplog.text and "another frame rate" in caplog.text
    if case == "3 frames short":
        assert "8 labels for 11 feature frames" in caplog.text
    assert not out.exists() and not list(tmp_path.glob("*.json*"))
    assert "k-means" not in caplog.text  # refused before any long work


@pytest.mark.timeout(90)
def test_evaluate_says_how_it_found_the_features_the_codecs_and_warns_of_joint_units_of_one_frame(data, tmp_path,
                                                                                                 caplog):
    """The feature check it made is said (and in the JSON); levels 1..k whose units have fewer than
    FRAMES_PER_UNIT code frames each get a warning naming them, since their joint PNMI counts frames."""
    d = data
    out = tmp_path / "eval.json"
    assert run_evaluate(d, "--alignments", d.phn, "--json", out) == 0
    result = json.loads(out.read_text())
    assert result["feature_check"].startswith("the statistics of the first")  # a dump with no tools.extract notes
    assert f"features: {result['feature_check']}" in caplog.text
    frames = result["code_frames"]
    thin = [level for level in result["levels"] if level["joint_units"] * evaluate.FRAMES_PER_UNIT > frames]
    assert thin, result["levels"]  # 16 codes a level over a few dozen code frames: few frames a unit
    k = thin[0]["level"]
    assert f"levels 1..{k} form {thin[0]['joint_units']} units over {frames} code frames" in caplog.text


@pytest.mark.timeout(10)
def test_the_joint_units_warning_names_the_first_levels_with_too_few_frames_a_unit(caplog):
    frames = 100
    many = {"joint_units": frames // evaluate.FRAMES_PER_UNIT, "joint_pnmi": 0.5}  # just enough frames each
    evaluate.warn_of_joint_units([{"level": 1, **many}], frames)
    assert "form" not in caplog.text
    few = {"joint_units": frames // evaluate.FRAMES_PER_UNIT + 1, "joint_pnmi": 0.99}
    evaluate.warn_of_joint_units([{"level": 1, **many}, {"level": 2, **few}, {"level": 3, **few}], frames)
    assert f"levels 1..2 form {few['joint_units']} units over {frames} code frames" in caplog.text
    assert "levels 1..3" not in caplog.text and "0.9900" in caplog.text


@pytest.mark.timeout(90)
def test_the_kmeans_baseline_is_fitted_once_for_the_same_features_and_again_for_others(data, tmp_path, caplog,
                                                                                       monkeypatch):
    """The baseline's centroids are cached, keyed on the frames they are fitted on, the clusters, the seed and the
    iterations: a second call on the same features reads them (the same figures), another seed fits anew."""
    d = data
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fits = []
    fit = evaluate.fit_kmeans
    monkeypatch.setattr(evaluate, "fit_kmeans", lambda *args, **kwargs: fits.append(1) or fit(*args, **kwargs))
    figures = []
    for seed in (0, 0, 1):
        out = tmp_path / f"eval{len(figures)}.json"
        assert run_evaluate(d, "--baseline", "kmeans", "--seed", seed, "--json", out) == 0
        figures.append(json.loads(out.read_text())["baseline"])
    assert len(fits) == 2  # seed 0 once, seed 1 once
    assert figures[1] == figures[0] and "k-means baseline: read from the cache" in caplog.text
    assert list((tmp_path / "cache" / "rvq_seamless" / evaluate.KMEANS_CACHE).glob("*.pt"))


@pytest.mark.timeout(90)
def test_a_full_disk_under_the_kmeans_cache_costs_the_cache_not_the_scores(data, tmp_path, caplog, monkeypatch):
    """The fitted centroids cannot be cached (the disk is full): a warning, no .tmp left, the scores still come."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    opened = io.open

    class Full(io.FileIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full(file, mode="r", *args, **kwargs):
        if str(file).endswith(".pt.tmp") and "w" in mode:
            return io.BufferedWriter(Full(file, "w"))
        return opened(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", full)
    out = tmp_path / "eval.json"
    assert run_evaluate(data, "--baseline", "kmeans", "--json", out) == 0
    assert "k-means baseline: could not be cached" in caplog.text and "No space left on device" in caplog.text
    assert json.loads(out.read_text())["baseline"]["method"] == "kmeans"
    assert not list(cache.rglob("*.tmp")) and not list(cache.rglob("*.pt"))
