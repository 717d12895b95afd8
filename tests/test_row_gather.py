"""data/row_gather.py: rows of different lengths into a padded pass and back in one gather and one scatter, the
same values as rows copied into place one at a time, for the w2v-BERT passes and the codec's alike."""
import numpy as np
import pytest
import torch

from benchmarks.host_syncs import count_host_syncs
from data.row_gather import packed_rows, padded_index, valid_positions
from models.codec import CodecConfig, RVQCodec
from training.codec_passes import encode_in_batches, padded_rows

pytestmark = pytest.mark.timeout(60)


def one_at_a_time(utterances, padded, width):
    """The pass built as it was: zeros, each row copied in, its tail up to padded[i] its last frame."""
    rows = np.zeros((len(utterances), width, utterances[0].shape[1]), np.float32)
    for row, (u, n) in enumerate(zip(utterances, padded)):
        rows[row, : len(u)] = u
        rows[row, len(u) : n] = u[-1:]
    return rows


@pytest.mark.parametrize("kind", ["array", "float16 array", "tensor"])
def test_a_codec_pass_is_the_rows_copied_one_at_a_time(kind):
    rng = np.random.default_rng(0)
    lengths = [0, 1, 3, 7, 8, 20]
    utterances = [rng.standard_normal((n, 5)).astype(np.float16 if "float16" in kind else np.float32)
                  for n in lengths]
    padded = np.array([0, 4, 4, 8, 8, 20])  # each to a multiple of 4
    want = one_at_a_time(utterances, padded, 20)
    given = [torch.from_numpy(u) for u in utterances] if kind == "tensor" else utterances
    got = padded_rows(given, padded, 5, 4)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)


def test_the_index_and_the_positions():
    firsts, lengths = np.array([0, 5, 6]), np.array([5, 1, 3])
    assert padded_index(firsts, lengths, 4, 99).reshape(3, 4).tolist() == [[0, 1, 2, 3], [5, 99, 99, 99],
                                                                            [6, 7, 8, 99]]
    repeated = padded_index(firsts, lengths, 4, 99, repeated=np.array([4, 3, 4])).reshape(3, 4)
    assert repeated.tolist() == [[0, 1, 2, 3], [5, 5, 5, 99], [6, 7, 8, 8]]
    source, target = valid_positions(np.array([10, 0]), np.array([2, 3]), 3)
    assert source.tolist() == [0, 1, 3, 4, 5] and target.tolist() == [10, 11, 0, 1, 2]
    packed = packed_rows([np.ones((2, 3)), np.full((1, 3), 2.0)])
    assert packed.tolist() == [[1, 1, 1], [1, 1, 1], [2, 2, 2], [0, 0, 0]]


def test_a_codec_batch_dispatches_the_same_ops_whatever_its_rows():
    """tools.tokenize on a GPU: the window's features are tensors on the device, and a batch's input and output
    take the same ops for 2 utterances as for 8 (before: a few a row, each a launch)."""
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=8, latent_dim=8, num_quantizers=2, codebook_size=16,
                                 kmeans_init=False)).eval()
    counts = {}
    for rows in (2, 8):
        features = [torch.randn(40 if i % 2 else 33, 8) for i in range(rows)]
        store = type("Store", (), {"lengths": np.array([len(f) for f in features]),
                                   "utterance": staticmethod(lambda i, f=features: f[i])})
        encode_in_batches(model, store, 2, 10**6, np.int16, beam_size=1, on_device=True)
        with count_host_syncs(count_ops=True) as counter:
            encode_in_batches(model, store, 2, 10**6, np.int16, beam_size=1, on_device=True)
        counts[rows] = sum(counter.ops_by_owner.values())
    assert counts[2] == counts[8], counts
