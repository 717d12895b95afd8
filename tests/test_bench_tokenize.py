"""benchmarks/bench_tokenize.py counts the FLOPs and replays the model alone on the passes of the windows whose
audio it counts."""
import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)


@pytest.mark.timeout(240)
def test_the_steady_state_counts_the_flops_and_the_passes_of_the_audio_it_counts(tmp_path):
    """5-s files make 250-frame chunks alone, so the FLOPs per audio second of the steady state are the model's
    at 5 s, exactly, whichever windows the clock spans: a pass counted from another window than its audio (the
    writer thread commits a window while the next one's passes run) would move them by a window's share."""
    from benchmarks.bench_tokenize import run_benchmark

    info = run_benchmark(device="cpu", model="small", mixes=("5s",), modes=("extract", "model"), audio_minutes=0.5,
                         base_minutes=0.5, commit_seconds=10, repeats=1, repos={"this tree": str(REPO)},
                         timeout=200, scratch_root=str(tmp_path), say=lambda line: None)
    row = info["runs"]["this tree"]["5s"]["extract"]
    assert "error" not in row, row
    assert row["commits"] >= 3 and not row["stopped_early"]  # the last window's passes end the run: none after it
    assert row["gflop_per_audio_s"] == pytest.approx(info["gflop_per_audio_s"]["5 s chunks"], rel=0.01)
    # the model alone replayed the steady windows' passes: 10 s windows of 5-s files, 2 files a window
    windows = row["commits"] - 1
    assert row["model"]["passes"] == windows
