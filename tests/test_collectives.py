"""The chunked all-reduce equals a plain all-reduce, element for element, on 2 gloo ranks."""
import pytest

from tests.helpers import run_gloo_ranks

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

SCRIPT = r"""
import torch, torch.distributed as dist
from training.distributed import DistContext, all_reduce_sum

dist.init_process_group("gloo")
rank = dist.get_rank()
ctx = DistContext(rank, 2, rank, torch.device("cpu"))
g = torch.Generator().manual_seed(rank)
for shape, chunk in [((1000,), 7), ((33, 17, 5), 64), ((4096,), 4096), ((3, 3), 1 << 22), ((0,), 5)]:
    for dtype in (torch.float32, torch.float64, torch.int64):
        x = (torch.randn(shape, generator=g) * 1000).to(dtype)
        plain = x.clone()
        dist.all_reduce(plain)
        chunked = all_reduce_sum(ctx, x.clone(), chunk_elements=chunk)
        assert torch.equal(plain, chunked), (shape, chunk, dtype)
        view = x.clone().t() if x.dim() == 2 else None  # non-contiguous input
        if view is not None:
            expect = view.contiguous()
            dist.all_reduce(expect)
            assert torch.equal(all_reduce_sum(ctx, view, chunk_elements=chunk), expect)
print("rank", rank, "equal")
dist.destroy_process_group()
"""


def test_chunked_all_reduce_equals_plain():
    outs = run_gloo_ranks(SCRIPT)
    assert all(f"rank {r} equal" in outs[r] for r in range(2))
