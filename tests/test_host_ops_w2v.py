"""The host's work in a w2v-BERT pass of the tools, counted as benchmarks/host_ops_w2v.py counts it: our attention
dispatches fewer ops a layer than transformers' own module on the same layer, makes its padding's tensors once a
pass, and asks the device for nothing, padded or not (transformers' own module reads a padded pass's mask back once);
a window's pass gathers its input
and scatters its output in the same few ops whatever its rows."""
import pytest

from benchmarks.host_ops_w2v import measure, measure_window, save_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("w2v"))


@pytest.fixture(scope="module")
def rows(model_folder):
    return {(r["kernel"], r["pass"]): r for r in measure(model_folder)}


def test_a_windows_pass_dispatches_the_same_ops_whatever_its_rows(model_folder):
    window = measure_window(model_folder)
    assert window["ops_per_row"] == 0, window  # a copy in and a copy out a row before: 11.5 ops a row
    assert max(window["ops_beyond_the_layers"].values()) <= 70, window


@pytest.mark.parametrize("padding", ["unpadded", "padded"])
def test_the_gpu_kernel_dispatches_fewer_ops_a_layer_than_transformers(rows, padding):
    triton, stock = rows["triton", padding], rows["stock", padding]
    assert triton["ops_per_layer"] <= stock["ops_per_layer"] - 5, (triton, stock)
    # the padding's tensors are made once a pass, not once a layer: a few ops of the pass itself
    assert triton["ops_of_the_pass_itself"] <= stock["ops_of_the_pass_itself"] + 8


def test_no_host_sync_comes_from_our_code_and_only_transformers_module_asks_one_of_a_padded_pass(rows):
    for (kernel, padding), row in rows.items():
        if kernel == "fold":  # the CPU's kernel: a read of a CPU tensor waits for nothing
            continue
        assert not [line for line in row["syncs_by_line"] if line.startswith(("data/", "tools/"))], row
        if padding == "unpadded" or kernel != "stock":  # the encoder hands our layers its padding mask as it is
            assert row["syncs_per_pass"] == 0, row
        else:  # transformers reads a padded pass's mask back once, to see whether it can drop it
            assert row["syncs_per_pass"] <= 1, row
