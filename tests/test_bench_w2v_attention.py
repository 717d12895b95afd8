"""benchmarks/bench_w2v_attention.py's GPU mode, as its --cpu-only run checks it here: every kernel that runs on
this CPU, stock and no bias side by side on the same weights, each one's error against stock."""
import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_the_gpu_mode_times_each_kernel_beside_stock_and_no_bias(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_w2v_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Triton kernel's row needs a GPU (or the interpreter)
    out = tmp_path / "attention.json"
    assert bench_w2v_attention.main(["--cpu-only", "--rounds", "1", "--passes", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    kernels = sorted({row["kernel"] for row in rows})
    assert kernels == ["fold", "gather", "no bias", "stock"]
    assert len(rows) == 4 * 4  # 2 batches, each as it is and half padded
    assert all(row["audio_seconds_per_second"] > 0 for row in rows)
    for row in rows:  # ours equal stock; leaving the bias out does not
        if row["kernel"] in ("fold", "gather"):
            assert row["relative_error_against_stock"] < 1e-5, row
        if row["kernel"] == "no bias":
            assert row["relative_error_against_stock"] > 1e-3, row
    padded = {row["audio_seconds"] for row in rows if row["padded"]}
    assert padded == {1.0 + 2.0, 3.0}  # 2 x 2 s with one row half padded; 1 x 6 s half padded
    assert result["float32_attention_error_against_gathered"]["fold"] < 1e-5
    table = capsys.readouterr().out
    assert "| fold / stock |" in table and "| fold / no bias |" in table
