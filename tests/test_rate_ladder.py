"""benchmarks/rate_ladder.py's bookkeeping: which levels make a rung, a stopped ladder going on, the table."""
import json

import numpy as np
import pytest

from benchmarks.rate_ladder import even_use_ceiling, resumed, rungs, table, usage_per_level


def test_rungs_are_the_levels_that_make_each_kbps_at_the_code_frame_rate():
    # 10 bits a level: 0.5 kbps a level at 50 Hz, 0.25 at 25 Hz, 0.125 at 12.5 Hz
    assert rungs(8, 1024, 1, (0.5, 1.0, 2.0, 4.0)) == {0.5: 1, 1.0: 2, 2.0: 4, 4.0: 8}
    assert rungs(4, 1024, 2, (0.5, 1.0, 2.0, 4.0)) == {0.5: 2, 1.0: 4}  # 2 and 4 kbps need 8 and 16 levels
    assert rungs(32, 1024, 4, (0.5, 4.0)) == {0.5: 4, 4.0: 32}
    assert rungs(8, 512, 1, (1.0,)) == {}  # 9 bits a level: 1 kbps is no whole number of levels


def report(**changed):
    return {"corpus": "speech_corpus", "budget": "10 minutes on m", "machine": "m", "valid_frames": 10,
            "train_frames": 90, "commands": ["python benchmarks/rate_ladder.py --out x"], "codecs": [],
            "baselines": [], **changed}


def test_a_stopped_ladder_goes_on_with_its_rows_and_both_commands(tmp_path):
    out = tmp_path / "ladder.json"
    assert resumed(report(), out) == report()  # nothing there yet
    row = {"codec": "50 Hz x 2", "kbps": 0.5, "levels": 1, "rel_mse": 0.03}
    first = report(codecs=[row])
    del first["commands"]
    first["command"] = "python benchmarks/rate_ladder.py --first"  # a report written before "commands"
    out.write_text(json.dumps(first))
    again = resumed(report(), out)
    assert again["codecs"] == [row]
    assert again["commands"] == ["python benchmarks/rate_ladder.py --first", "python benchmarks/rate_ladder.py --out x"]
    assert "command" not in again


@pytest.mark.parametrize("changed", [{"corpus": "demo"}, {"budget": "2000 steps on m"}, {"valid_frames": 11}])
def test_a_report_of_another_ladder_is_refused_not_mixed(tmp_path, changed):
    out = tmp_path / "ladder.json"
    out.write_text(json.dumps(report(**changed)))
    with pytest.raises(SystemExit, match="holds another ladder"):
        resumed(report(), out)


def test_the_table_gives_each_rung_against_faiss_beam_8_of_the_same_kbps():
    rows = [{"codec": "25 Hz x 4", "kbps": 1.0, "levels": 4, "rel_mse": 0.018, "lowest_usage": 0.9,
             "level_1_pnmi": 0.78, "steps": 4580}]
    base = [{"kbps": 1.0, "levels": 2, "beam": b, "rel_mse": m, "lowest_usage": 0.95, "level_1_pnmi": None}
            for b, m in ((1, 0.0225), (8, 0.0200))]
    lines = table(report(codecs=rows, baselines=base)).splitlines()
    assert "| 25 Hz x 4, first 4 | 1 | 0.01800 | 0.90 | 90.0% |  | 0.780 | 4,580 |" in lines  # an older row
    assert "| faiss RQ 50 Hz x 2, beam 1 | 1 | 0.02250 | 1.12 | 95.0% | |  | |" in lines
    rows[0].update(usage_ceiling=0.983, lowest_usage_train=0.951)
    lines = table(report(codecs=rows, baselines=base)).splitlines()
    assert "| 25 Hz x 4, first 4 | 1 | 0.01800 | 0.90 | 90.0% (98.3%) | 95.1% | 0.780 | 4,580 |" in lines


def test_usage_counts_each_level_apart_and_its_ceiling_is_that_of_an_evenly_used_codebook():
    codes = np.array([[0, 5], [1, 5], [2, 5], [2, 6]])
    assert usage_per_level(codes, 4).tolist() == [0.75, 0.5]
    assert even_use_ceiling(1, 1024) == pytest.approx(1 / 1024)
    # 4,142 code frames (the speech corpus's held-out frames at 25 Hz) of an evenly used 1,024-code level: 98.3%
    assert even_use_ceiling(4142, 1024) == pytest.approx(0.983, abs=5e-4)
    rng = np.random.default_rng(0)  # the ceiling is what random draws of an even codebook show
    drawn = np.mean([len(np.unique(rng.integers(0, 1024, 4142))) / 1024 for _ in range(200)])
    assert drawn == pytest.approx(even_use_ceiling(4142, 1024), abs=2e-3)


def test_every_codec_can_be_named_on_the_command_line():
    from benchmarks.rate_ladder import BEFORE, CODECS, LADDER, TRIALS, ladder_codec

    assert not [n for n in CODECS if "," in n]  # --codecs is comma-separated
    assert set(TRIALS) <= set(CODECS)
    # each codec again with the schedule before, by a name its rows in the committed reports carry, and drawn in
    # its codec's colour
    before = [n for n in CODECS if n.endswith(f"({BEFORE[0]})")]
    assert len(before) == len(CODECS) / 2 and set(before) <= set(TRIALS)
    assert {ladder_codec(n) for n in before} == set(CODECS) - set(before)
    assert CODECS["25 Hz x 4 (lr 2e-3 decaying to 10%)"] == [*CODECS["25 Hz x 4"], *BEFORE[1]]
    assert BEFORE[1] == ["--lr", "2e-3", "--min_lr_ratio", "0.1"]
    assert ladder_codec("50 Hz x 8 (lr 2e-3 decaying to 10%)") == LADDER[0] == "50 Hz x 8 (defaults)"


def test_its_help_runs_with_a_percent_sign_in_a_codec_name(monkeypatch, capsys):
    from benchmarks.rate_ladder import main

    monkeypatch.setattr("sys.argv", ["rate_ladder.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        main()  # a '%' in a codec's name must reach argparse escaped
    assert stop.value.code == 0
    assert "lr 2e-3 decaying to 10%)" in " ".join(capsys.readouterr().out.split())
