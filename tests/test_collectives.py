"""The chunked all-reduce equals a plain all-reduce, element for element, on 2 gloo ranks."""
import subprocess
import sys

from tests.helpers import REPO, env, free_port

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
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(f"rank {r} equal" in outs[r] for r in range(2))
