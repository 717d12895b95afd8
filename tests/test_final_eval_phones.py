"""The run's final eval reports PNMI, phone purity and cluster purity per level when `{split}.phn` lies beside the
held-out features: the figures tools.evaluate gives on the same checkpoint and split, on one rank or two; a bad
.phn ends every rank before the first step (exit 2, nothing written)."""
import json
import logging

import numpy as np
import pytest

from models.unit_quality import quality_from_counts, unit_quality
from tests.helpers import TINY, events, run_gloo_ranks, run_torchrun, trainer_in_process, write_fairseq
from tools import evaluate, report

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

VALID = [50, 37, 64, 45, 33]
# a short run whose end-of-schedule work is cheap: the final eval scores every held-out utterance whole
RUN = [*TINY, "--max_steps", "3", "--eval_frames", "0", "--refit_iters", "0", "--kmeans_init_frames", "1024"]
PHONE_KEYS = ("pnmi", "phone_purity", "cluster_purity")


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    """train and valid dumps, and valid.phn: phones in runs of 1-6 frames, one line per held-out utterance."""
    folder = tmp_path_factory.mktemp("phones") / "feats"
    rng = np.random.default_rng(0)
    write_fairseq(folder, "train", rng.integers(40, 120, size=40).tolist())
    write_fairseq(folder, "valid", VALID, seed=1)
    lines = [" ".join(np.repeat(rng.choice(["a", "b", "c", "sil"], size=n), rng.integers(1, 7, size=n))[:n])
             for n in VALID]
    (folder / "valid.phn").write_text("\n".join(lines) + "\n")
    return folder


def pnmi_of_tools_evaluate(feats, run, tmp_path) -> list[dict]:
    """tools.evaluate's phone measures per level on the run's checkpoint, batched as the final eval batches."""
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", run, "--data_dir", feats, "--split", "valid", "--alignments",
                          feats / "valid.phn", "--batch_frames", 4 * 32, "--json", out]) == 0
    return json.loads(out.read_text())["levels"]


def assert_final_eval_scores_as_tools_evaluate(feats, run, tmp_path):
    final = events(run, "eval")[-1]
    assert final["scored"] == "whole utterances" and final["frames"] == sum(VALID) and final["phones"] == 4
    levels = pnmi_of_tools_evaluate(feats, run, tmp_path)
    for key in PHONE_KEYS:
        assert len(final[key]) == 2
        assert final[key] == pytest.approx([level[key] for level in levels], rel=1e-9, abs=1e-12), key


@pytest.mark.timeout(10)
def test_phone_measures_from_counts_are_unit_qualitys():
    rng = np.random.default_rng(1)
    phones, units = rng.integers(0, 7, 500), rng.integers(0, 40, 500)
    units[:200] = phones[:200] * 3  # some phone information
    counts = np.zeros((9, 48))  # phones and units never seen: rows and columns of zeros
    np.add.at(counts, (phones, units), 1)
    assert quality_from_counts(counts) == pytest.approx(unit_quality(phones, units), rel=1e-12)
    assert quality_from_counts(np.diag([3.0, 5.0, 0.0])) == pytest.approx(
        {"pnmi": 1.0, "phone_purity": 1.0, "cluster_purity": 1.0})


@pytest.mark.timeout(90)
def test_one_rank_run_reports_per_level_pnmi_as_tools_evaluate_scores_it(feats, tmp_path):
    run = tmp_path / "run"
    r = trainer_in_process(["--data_dir", feats, "--output_dir", run, *RUN])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "per level against the 4 phones of" in r.stderr and "PNMI" in r.stderr
    assert all("pnmi" not in e for e in events(run, "eval")[:-1])  # the evals during training: windows, no phones
    assert_final_eval_scores_as_tools_evaluate(feats, run, tmp_path)
    report.write_report(run, tmp_path / "report")  # the plot per level, and the table's row
    assert (tmp_path / "report" / report.PHONE_PLOT).is_file()
    pnmi = ", ".join(f"{v:.3g}" for v in events(run, "eval")[-1]["pnmi"])
    text = (tmp_path / "report" / "report.md").read_text()
    assert f"| PNMI per level (final eval at step 3, 4 phones) | {pnmi} |" in text


@pytest.mark.timeout(90)
def test_two_rank_run_sums_the_phone_counts_of_both_ranks(feats, tmp_path):
    """Each rank scores its own held-out utterances; their joint counts summed give what one process gives."""
    run = tmp_path / "run"
    r = run_torchrun(["--data_dir", feats, "--output_dir", run, *RUN], timeout=80)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_final_eval_scores_as_tools_evaluate(feats, run, tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["3 frames short", "a line missing"])
def test_a_bad_phn_exits_2_before_the_first_step_naming_the_utterance(feats, tmp_path, case):
    data = tmp_path / "feats"
    data.mkdir()
    for path in feats.iterdir():
        (data / path.name).symlink_to(path)
    (data / "valid.phn").unlink()
    lines = (feats / "valid.phn").read_text().splitlines()
    lines = [lines[0], " ".join(lines[1].split()[:-3]), *lines[2:]] if case == "3 frames short" else lines[:-1]
    (data / "valid.phn").write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, "--output_dir", run, *RUN])
    assert r.returncode == 2, r.stderr[-3000:]
    if case == "3 frames short":
        assert "valid_0_1.npy utterance 1 (rows 50-87): line 2 of valid.phn has 34 labels for 37 feature frames" \
            in r.stderr
    else:
        assert "valid_0_1.npy utterance 4 (rows 196-229): no alignment" in r.stderr and "4 lines for 5" in r.stderr
    assert "fix it, or move it away to train without PNMI" in r.stderr
    assert not run.exists() and "codec:" not in r.stderr  # refused before the model is built


@pytest.mark.timeout(30)
def test_utterances_held_out_of_train_get_no_phones(tmp_path, caplog):
    """train.phn labels the training split: reading it would grow with the corpus, so it is not read."""
    from data.training_data import DataConfig, open_training_data

    feats = tmp_path / "feats"
    write_fairseq(feats, "train", [40] * 50)
    (feats / "train.phn").write_text("".join("a " * 40 + "\n" for _ in range(50)))
    caplog.set_level(logging.INFO)
    data = open_training_data(DataConfig(data_dir=str(feats), batch_size=4, segment_length=32), rank=0,
                              world_size=1, seed=0, multiple_of=1, device_type="cpu")
    assert data.eval.phones is None
    assert "train.phn is not read" in caplog.text and "give a 'valid' split with its valid.phn" in caplog.text


AGREE = r"""
import sys, torch, torch.distributed as dist
from pathlib import Path
from data.training_data import EvalPhones
from errors import BadInputError
from training.distributed import DistContext
from training.evaluate import agree_on_phones

dist.init_process_group("gloo")
rank = dist.get_rank()
ctx = DistContext(rank, 2, rank, torch.device("cpu"))
cases = {"alike": [EvalPhones(Path("valid.phn"), "ab12"), EvalPhones(Path("valid.phn"), "ab12")],
         "differ": [EvalPhones(Path("valid.phn"), "ab12"), EvalPhones(Path("valid.phn"), "cd34")],
         "one rank has none": [EvalPhones(Path("valid.phn"), "ab12"), None],
         "bad on rank 0": [EvalPhones(Path("valid.phn"), "ab12", error="utterance 3: bad"),
                           EvalPhones(Path("valid.phn"), "ab12", error="utterance 3: bad")]}
for name, phones in cases.items():
    try:
        agree_on_phones(ctx, phones[rank])
        print(name, "agreed")
    except BadInputError as e:
        print(name, "refused:", e)
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_ranks_agree_on_the_phone_labels_or_all_refuse_them():
    outs = run_gloo_ranks(AGREE)
    for rank, out in enumerate(outs):
        assert "alike agreed" in out
        assert "differ refused: the held-out split's phone labels differ between ranks" in out
        assert "one rank has none refused" in out and "rank 1: none" in out
        assert ("bad on rank 0 refused: " + ("" if rank == 0 else "rank 0: ") + "utterance 3: bad") in out


@pytest.mark.timeout(30)
def test_an_utterance_left_out_of_the_final_eval_takes_its_labels_with_it(tmp_path):
    """An utterance with a NaN frame is not scored: the phone counts hold the labels of the others, at the code
    rate (downsample 2: each code frame labelled by its first feature frame), one per code frame scored."""
    import torch

    from data.stores import find_split
    from data.training_data import EvalPhones, EvalWindows
    from models.codec import CodecConfig, RVQCodec
    from training.evaluate import score_utterances

    utterances = write_fairseq(tmp_path, "valid", [9, 12, 7, 10])
    utterances[1][3, 0] = np.nan
    np.save(tmp_path / "valid_0_1.npy", np.concatenate(utterances))
    store = find_split(tmp_path, "valid")
    rng = np.random.default_rng(2)
    labels = [rng.integers(0, 3, n) for n in store.lengths]
    windows = EvalWindows(store, np.zeros(0, np.int64), np.zeros(0, np.int64), 8, whole=np.arange(4),
                          phones=EvalPhones(tmp_path / "valid.phn", "", phones=["a", "b", "c"], labels=labels))
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=16, latent_dim=8, num_quantizers=2, codebook_size=8, kmeans_init=False,
                                 downsample=2))
    sums = score_utterances(model, windows, torch.device("cpu"), batch_frames=24, beam_size=1)
    scored = np.concatenate([labels[i][::2] for i in (0, 2, 3)])
    assert int(sums.frames) == 9 + 7 + 10
    for level in range(2):
        assert sums.joint[level].sum(1).tolist() == np.bincount(scored, minlength=3).tolist()
        assert sums.joint[level].sum(0).tolist() == sums.histogram[level].tolist()
    result = sums.result(2)
    assert result["phones"] == 3 and len(result["pnmi"]) == 2
