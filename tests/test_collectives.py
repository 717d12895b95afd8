"""The control plane's collectives on 2 gloo ranks: the chunked all-reduce equals a plain one, element for element;
the agreement primitives give every rank the same answer, and a refusal raises on every rank together."""
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


AGREE = r"""
import torch, torch.distributed as dist
from errors import BadInputError
from training.distributed import DistContext, agree, exchange, raise_together, rank0_decides

dist.init_process_group("gloo")
rank = dist.get_rank()
ctx = DistContext(rank, 2, rank, torch.device("cpu"), control=dist.group.WORLD)
assert agree(ctx, {"rank": rank, "found": f"r{rank}"}) == [{"rank": 0, "found": "r0"}, {"rank": 1, "found": "r1"}]
assert rank0_decides(ctx, ("rank 0's choice" if rank == 0 else "ignored", rank)) == ("rank 0's choice", 0)
assert exchange(ctx, [rank, 2.5]).tolist() == [[0.0, 2.5], [1.0, 2.5]]
raise_together(ctx, None, BadInputError)  # no error: nobody raises
for source in (0, 1):
    try:
        raise_together(ctx, f"found on rank {source}", BadInputError, rank=source)
    except BadInputError as e:
        print("rank", rank, "raised:", e)
dist.destroy_process_group()
"""


def test_agreement_primitives_answer_every_rank_alike_and_raise_together():
    outs = run_gloo_ranks(AGREE)
    assert "rank 0 raised: found on rank 0" in outs[0] and "rank 1 raised: rank 0: found on rank 0" in outs[1]
    assert "rank 0 raised: rank 1: found on rank 1" in outs[0] and "rank 1 raised: found on rank 1" in outs[1]



CHECKS = r"""
import types, torch, torch.distributed as dist
import training.sync_check as sync
from training.distributed import DistContext

dist.init_process_group("gloo")
rank = dist.get_rank()
ctx = DistContext(rank, 2, rank, torch.device("cpu"), control=dist.group.WORLD)
clock = [0.0]
sync.time = types.SimpleNamespace(monotonic=lambda: clock[0])  # each rank's own clock, moved by hand
checks = sync.CheckSchedule(50, start_step=0)
seen = []
for step in range(1, 121):
    # rank 0's steps take 0.7 x STOP_CHECK_SECONDS up to step 3, then 1 ms; rank 1's always 1 ms
    clock[0] += 0.7 * sync.STOP_CHECK_SECONDS if rank == 0 and step <= 3 else 0.001
    if checks.due(step):
        sync.sync_check(ctx, step=step, epoch=0, samples_seen=step, stop=False, out_of_time=False,
                        steps_in_time=None, codebooks=[torch.ones(4, 3)], checks=checks)
        seen.append(step)
print("rank", rank, "checks", seen)
dist.destroy_process_group()
"""


def test_sync_checks_come_by_rank_0s_clock_and_at_every_multiple_of_sync_check_every():
    """Slow steps on rank 0 bring a check after every one (a stop waits about STOP_CHECK_SECONDS at most); fast
    ones leave them at every multiple of --sync_check_every. Rank 1's clock, always fast, has no say."""
    outs = run_gloo_ranks(CHECKS)
    for rank in (0, 1):
        assert f"rank {rank} checks [1, 2, 3, 4, 50, 100]" in outs[rank], outs
