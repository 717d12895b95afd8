"""The codebook refit on 2 gloo ranks: each rank fits on its own frames, and every rank ends with the same codebooks."""
import pytest

from tests.helpers import run_gloo_ranks

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

SCRIPT = r"""
import torch, torch.distributed as dist
from models.codec import CodecConfig, RVQCodec
from training.distributed import DistContext, all_reduce_sum

dist.init_process_group("gloo")
rank = dist.get_rank()
ctx = DistContext(rank, 2, rank, torch.device("cpu"))
torch.manual_seed(0)  # the same model on both ranks, as after training
model = RVQCodec(CodecConfig(feature_dim=6, latent_dim=8, num_quantizers=2, codebook_size=32))
model.init_codebooks(torch.randn(8, 16, 6) * 0.05, batch_frames=64)
model.eval()
g = torch.Generator().manual_seed(100 + rank)  # different frames on each rank
utterances = [torch.randn(int(n), 6, generator=g) * (1 + rank) for n in torch.randint(50, 300, (5,), generator=g)]
errors = model.refit_codebooks(utterances, iters=3, batch_frames=64, all_reduce=lambda t: all_reduce_sum(ctx, t))
for layer in model.rvq.layers:
    mine = layer._codebook.embed.clone()
    other = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(other, mine)
    assert torch.equal(other[0], other[1]), "codebooks differ across ranks"
    size = layer._codebook.cluster_size.clone()
    dist.all_reduce(size)
    assert torch.equal(size, 2 * layer._codebook.cluster_size)
print("rank", rank, "same codebooks", errors)
dist.destroy_process_group()
"""


def test_refit_on_two_ranks_gives_every_rank_the_same_codebooks():
    outs = run_gloo_ranks(SCRIPT)
    assert all(f"rank {r} same codebooks" in outs[r] for r in range(2))
