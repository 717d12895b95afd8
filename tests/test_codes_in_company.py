"""On a CPU, in float32, an utterance's codes are the same alone and in any company: in a list, in the list
reversed, beside a long stranger, and under other window and pass sizes (tools.tokenize's --commit_seconds and
--batch_seconds), with w2v-BERT's chunks (1 s here) shared out among passes. benchmarks/codes_in_company.py measures
the same on a GPU, where bf16 products may change their last bits with a pass's shape."""
import numpy as np
import pytest
import soundfile as sf

import rvq_tokenizer
from tests.audio_helpers import CORPUS, random_codec, tiny_w2v_bert, voice_like, write_corpus
from tools import extract, tokenize

pytestmark = pytest.mark.timeout(240)
W2V = ["--feature", "w2v-bert", "--layer", 1, "--max_chunk_seconds", 1.0, "--device", "cpu"]
SHARD = "train_0_1"


@pytest.fixture(scope="module")
def company(tmp_path_factory):
    """Eight files of 1-3 s (three rates, stereo among them), a tiny w2v-BERT, an untrained codec on its features,
    the tokenizer, and each file's codes alone (a shard of that one file)."""
    root = tmp_path_factory.mktemp("company")
    relpaths = write_corpus(root / "audio", CORPUS[:8])
    model = tiny_w2v_bert(root / "w2v_bert")
    assert extract.main([root / "audio", "train", 1, 0, root / "feats", *W2V, "--checkpoint", model]) == 0
    codec = random_codec(root / "codec.pt", root / "feats", num_quantizers=3, codebook_size=32)
    tokenizer = rvq_tokenizer.load(codec, device="cpu")
    read = [sf.read(root / "audio" / rel, dtype="float32") for rel in relpaths]
    waves, rates = [w for w, _ in read], [r for _, r in read]
    alone = [tokenizer.encode(w, r) for w, r in zip(waves, rates)]
    return root, codec, tokenizer, waves, rates, alone


def shard_codes(folder) -> list[np.ndarray]:
    codes = np.load(folder / f"{SHARD}.codes.npy")
    lengths = [int(n) for n in (folder / f"{SHARD}.codes.len").read_text().split()]
    return np.split(codes, np.cumsum(lengths)[:-1])


def same(alone: list[np.ndarray], other: list[np.ndarray]) -> bool:
    return len(alone) == len(other) and all(np.array_equal(a, b) for a, b in zip(alone, other))


def test_codes_are_the_same_alone_in_a_list_reversed_and_beside_a_long_stranger(company):
    _, _, tokenizer, waves, rates, alone = company
    stranger = voice_like(6.0, 16000, seed=99).astype(np.float32)
    assert same(alone, tokenizer.encode(waves, rates))
    assert same(alone, tokenizer.encode(waves[::-1], rates[::-1])[::-1])
    assert same(alone, tokenizer.encode([stranger, *waves], [16000, *rates])[1:])
    assert same(alone, tokenizer.encode([*waves, stranger, *waves], [*rates, 16000, *rates])[-len(waves):])


@pytest.mark.parametrize("flags", [[], ["--commit_seconds", 2.5], ["--batch_seconds", 1.5],
                                   ["--commit_files", 3, "--batch_seconds", 4]],
                         ids=["defaults", "windows of 2.5 s", "passes of 1.5 s", "windows of 3 files"])
def test_tools_tokenize_gives_each_file_its_codes_alone_whatever_its_windows_and_passes(company, tmp_path, flags):
    root, codec, _, _, _, alone = company
    assert tokenize.main([root / "audio", "train", 1, 0, tmp_path, "--checkpoint", codec, *flags]) == 0
    assert same(alone, shard_codes(tmp_path))
