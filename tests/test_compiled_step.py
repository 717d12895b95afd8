"""The training step under torch.compile (--compile): one graph with no break, the same numbers as eager, exact
resume, the same codebooks on every rank, and the quantizer's bookkeeping outside the step."""
import re
import time
from pathlib import Path

import pytest
import torch

from data.bad_crops import finite_crops
from errors import BadInputError
from models.codec import CodecConfig, RVQCodec
from models.compiled_step import CPU_COMPILE_MIN_STEPS, compile_mode, depth_seeds
from tests.helpers import TINY, Ranks, events, newest_checkpoint, run_trainer
from training.checkpoint import load_checkpoint
from training.step_guard import StepOutcome, guarded_step

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

# Compiled against eager, in float32 on a CPU: inductor fuses and reorders sums, so values differ in the last bits
# and the difference grows a little with every step that feeds on the last; these bounds leave ~10x margin.
STEP_RTOL, STEP_ATOL = 1e-4, 1e-5


def small_codec(**options) -> RVQCodec:
    torch.manual_seed(0)
    return RVQCodec(CodecConfig(feature_dim=12, latent_dim=16, num_quantizers=3, codebook_size=16, **options)).train()


def dropout_variants(model: RVQCodec) -> list[int | None]:
    """The dropout seeds a compiled training forward has a graph for: one per quantize-dropout depth ([None]
    without quantize dropout)."""
    rvq = model.rvq
    if not rvq.quantize_dropout:
        return [None]
    return list(depth_seeds(rvq.quantize_dropout_cutoff_index, rvq.num_quantizers).values())


def test_the_training_forward_is_one_graph_with_no_break():
    """An upgrade of the library or of torch that puts a host read back into the step fails here."""
    model = small_codec()
    x, keep = torch.randn(4, 16, 12), torch.tensor([True, False, True, True])
    model.init_codebooks(torch.randn(8, 16, 12), batch_frames=64)
    assert model.init_done()
    explained = torch._dynamo.explain(model._forward)(x, keep, 1, None)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_codec_loaded_from_a_checkpoint_compiles_to_the_same_one_graph():
    """A resumed run loads its codebooks instead of running the k-means init, whose eager forwards made the
    library's `zero` buffers require grad; compile_training sets them so, or the library's requires_grad_() call
    breaks the graph (a resumed compiled run then rounds otherwise than an unbroken one)."""
    trained = small_codec()
    trained.init_codebooks(torch.randn(8, 16, 12), batch_frames=64)
    model = small_codec()
    model.load_state_dict(trained.state_dict())
    assert model.init_done()
    model.compile_training()  # lazy: nothing is traced or compiled until a call
    x, keep = torch.randn(4, 16, 12), torch.tensor([True, False, True, True])
    explained = torch._dynamo.explain(model._forward)(x, keep, 1, None)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_under_quantize_dropout_the_only_breaks_are_the_librarys_depth_branch():
    """The library draws the depth with Python's random.Random(seed), which torch.compile feeds to the graph as
    an input, so its comparisons with the depth at the head of its loop over levels (`is_last_step = ... ==
    depth`, `if quantizer_index > depth:`) split the graph (no device read, no collective): torch 2.13 breaks
    at the `if`, torch 2.11 at the comparison before it and the loop's own line; any other break fails here."""
    import vector_quantize_pytorch.residual_vq as library

    source = Path(library.__file__).read_text().splitlines()
    loop = next(i for i, line in enumerate(source, 1) if "for quantizer_index, (vq," in line)
    branch = next(i for i, line in enumerate(source, 1)
                  if i > loop and "quantizer_index > rand_quantize_dropout_index" in line)
    model = small_codec(quantize_dropout=True)
    x = torch.randn(4, 16, 12)
    model.init_codebooks(torch.randn(8, 16, 12), batch_frames=64)
    for seed in dropout_variants(model):
        explained = torch._dynamo.explain(model._forward)(x, None, 1, seed)
        where = [(Path(reason.user_stack[-1].filename).name, reason.user_stack[-1].lineno)
                 for reason in explained.break_reasons]
        assert where, "no break at all: the library no longer branches on the depth (update this test)"
        assert all(name == "residual_vq.py" and loop <= line <= branch for name, line in where), \
            (where, (loop, branch), explained.break_reasons)


@pytest.mark.parametrize("kernel,padding", [(1, 0), (2, 0), (3, 1), (3, 0), (4, 2), (5, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_convolution_as_a_matrix_product_gives_the_convolutions_numbers(kernel, padding, bias):
    """models/conv_products.py's product against torch.conv1d, forward and backward (eager: the same function the
    compiled graph runs)."""
    from models.conv_products import conv1d_products

    generator = torch.Generator().manual_seed(kernel * 10 + padding)
    x = torch.randn(3, 5, 11, generator=generator, requires_grad=True)
    weight = torch.randn(7, 5, kernel, generator=generator, requires_grad=True)
    b = torch.randn(7, generator=generator, requires_grad=True) if bias else None
    grad = torch.randn(3, 7, 11 + 2 * padding - kernel + 1, generator=generator)
    want = torch.conv1d(x, weight, b, padding=padding)
    got = conv1d_products(x, weight, b, padding)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    inputs = [x, weight] + ([b] if bias else [])
    torch.testing.assert_close(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad),
                               rtol=1e-5, atol=1e-5)


def test_on_a_cpu_each_rewrite_leaves_what_is_outside_its_size_bound(monkeypatch):
    """The compiled CPU step's rewrites (models/compiled_step.py), on the graph as captured: the one-hot products
    are rewritten from MIN_MULTIPLY_ADDS up, so at this codec's size they stay products (slower, not wrong); each
    stride-1 convolution under MAX_MULTIPLY_ADDS becomes a matrix product, and the larger ones stay. (That the
    rewritten step gives eager's numbers: test_compiled_equals_eager_through_expiry_and_a_skipped_step.)"""
    import models.conv_products as conv_products
    from models.compiled_step import CONV_PRODUCTS, ONE_HOT_PRODUCTS

    model = small_codec()
    x, keep = torch.randn(4, 16, 12), torch.tensor([True, False, True, True])
    model.init_codebooks(torch.randn(8, 16, 12), batch_frames=64)
    graph = torch._dynamo.explain(model._forward)(x, keep, 1, None).graphs[0].graph  # captured, not compiled
    before = ONE_HOT_PRODUCTS.rewritten
    ONE_HOT_PRODUCTS(graph)
    assert ONE_HOT_PRODUCTS.rewritten == before  # 64 frames x 16 codes x 16 dims: under the size, left as products
    # 64 frames x 16 in x 16 out x 3 = 49,152 multiply-adds for the five 16 -> 16 convolutions of kernel 3 (a
    # residual block's first, and the decoder's input), 16,384 or 36,864 for the seven others: a bound between
    # leaves those five as convolutions
    monkeypatch.setattr(conv_products, "MAX_MULTIPLY_ADDS", 40_000)
    before = CONV_PRODUCTS.rewritten
    CONV_PRODUCTS(graph)
    assert CONV_PRODUCTS.rewritten - before == 7
    assert sum(node.target is torch.conv1d for node in graph.nodes) == 5


def test_before_the_init_the_forward_reads_the_flag_and_after_it_never():
    model = small_codec()
    x = torch.randn(4, 16, 12)
    explained = torch._dynamo.explain(model._forward)(x, None, 1, None)  # the library's `if self.initted:`
    assert explained.graph_break_count > 0
    model(x)  # the k-means init on the first batch
    assert model.init_done()
    assert torch._dynamo.explain(model._forward)(x, None, 1, None).graph_break_count == 0


def test_every_tensor_in_the_graph_is_on_the_models_device():
    """What CUDA graphs need that a CPU can check: traced on the meta device, a tensor made on the host inside
    the step (a constant, a .cpu()) would show as a CPU value in the graph."""
    model = small_codec()
    model.init_codebooks(torch.randn(8, 16, 12), batch_frames=64)
    model.to("meta")
    x, keep = torch.randn(4, 16, 12, device="meta"), torch.ones(4, dtype=torch.bool, device="meta")
    explained = torch._dynamo.explain(model._forward)(x, keep, 1, None)
    assert explained.graph_count == 1
    devices = {value.device.type for graph in explained.graphs for node in graph.graph.nodes
               for value in [node.meta.get("example_value")] if isinstance(value, torch.Tensor)}
    assert devices == {"meta"}, devices


def run_steps(compiled: bool, steps: int = 7, nan_at: int = 4) -> list[dict]:
    """The trainer's step by hand: forward, backward, clip, the guard; a skipped step restores the codebooks;
    an applied one may expire dead codes (every 2 steps here)."""
    model = small_codec(dead_code_every=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    generator = torch.Generator().manual_seed(1)
    model.init_codebooks(torch.randn(8, 16, 12, generator=generator), batch_frames=64)
    if compiled:
        model.compile_training()
    torch.manual_seed(2)  # the expiry samples its new codes
    record, before = [], None
    for step in range(1, steps + 1):
        x = torch.randn(4, 16, 12, generator=generator)
        if step == 3:
            x[2, 5, 1] = float("nan")  # a NaN in the data: its crop is dropped on the device, the step trains
        keep = finite_crops(x)  # as the trainer marks each batch's crops (data/bad_crops.py)
        before = model.codebook_state(into=before)
        out = model(x, keep)
        loss = out.loss * float("nan") if step == nan_at else out.loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        outcome = guarded_step(scaler, optimizer, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        expired = 0
        if outcome is StepOutcome.APPLIED:
            expired = model.maybe_expire_dead_codes(step, out)
        else:
            model.restore_codebook_state(before)
        optimizer.zero_grad(set_to_none=True)
        record.append({"loss": out.loss.detach(), "codes": out.codes.clone(), "grads": grads, "outcome": outcome,
                       "expired": expired, "buffers": [b.clone() for b in model.quantizer_buffers()],
                       "weights": [p.detach().clone() for p in model.parameters()]})
    assert (model._compiled_step is not None) == compiled
    return record


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rewrites", ["none", "both"], ids=["as written", "convolutions and one-hot products"])
def test_compiled_equals_eager_through_expiry_and_a_skipped_step(monkeypatch, rewrites):
    """The CPU's graph rewrites: none (as on a GPU); and both, the small convolutions (models/conv_products.py),
    as at this codec's size, and the one-hot products (models/one_hot_products.py) at any size, as on the
    default codec (the convolutions alone, as the tests' trainer runs compile them, rewrite the same nodes). A
    second codec's compiled run is served by the same graph and repeats the first bit for bit."""
    import models.conv_products as conv_products
    import models.one_hot_products as one_hot_products
    from models.compiled_step import CONV_PRODUCTS, ONE_HOT_PRODUCTS

    if rewrites == "none":
        monkeypatch.setattr(conv_products, "MAX_MULTIPLY_ADDS", 0)
    if rewrites == "both":
        monkeypatch.setattr(one_hot_products, "MIN_MULTIPLY_ADDS", 0)
    torch._dynamo.reset()  # compiled here, not served from another test's graph
    before = ONE_HOT_PRODUCTS.rewritten, CONV_PRODUCTS.rewritten
    eager, compiled, again = run_steps(compiled=False), run_steps(compiled=True), run_steps(compiled=True)
    convs = 12  # 1 + 2 x 2 + 1 in the encoder, as many in the decoder
    assert (ONE_HOT_PRODUCTS.rewritten - before[0], CONV_PRODUCTS.rewritten - before[1]) == {
        "none": (0, 0), "both": (2 * 3, convs)}[rewrites]  # 2 a level, 3 levels, once: one graph serves both runs
    assert [r["outcome"] for r in eager] == [r["outcome"] for r in compiled]
    assert eager[2]["outcome"] is StepOutcome.APPLIED and torch.isfinite(eager[2]["loss"])  # NaN data, dropped
    assert eager[3]["outcome"] is StepOutcome.BAD  # the NaN step, skipped
    torch.testing.assert_close(eager[3]["buffers"], eager[2]["buffers"], rtol=0, atol=0)  # and undone
    assert [r["expired"] for r in eager] == [r["expired"] for r in compiled]
    assert sum(r["expired"] for r in eager) > 0  # levels with dead codes were re-seeded
    for step, (a, b, c) in enumerate(zip(eager, compiled, again), 1):
        msg = f"step {step}"
        assert torch.equal(a["codes"], b["codes"]), msg
        for key in ("loss", "codes", "grads", "buffers", "weights"):
            torch.testing.assert_close(c[key], b[key], rtol=0, atol=0, equal_nan=True, msg=f"{msg}: {key}")
        torch.testing.assert_close(a["loss"], b["loss"], rtol=STEP_RTOL, atol=STEP_ATOL, msg=msg)
        torch.testing.assert_close(a["grads"], b["grads"], rtol=STEP_RTOL, atol=STEP_ATOL, equal_nan=True, msg=msg)
        torch.testing.assert_close(a["buffers"], b["buffers"], rtol=STEP_RTOL, atol=STEP_ATOL, msg=msg)
        torch.testing.assert_close(a["weights"], b["weights"], rtol=STEP_RTOL, atol=STEP_ATOL, msg=msg)


@pytest.mark.timeout(240)
def test_no_host_sync_from_the_quantizer_between_expiries():
    """The library's init-flag and dead-code reads are gone from the step: eager on a CPU only F.one_hot's index
    check is left (a CPU-only check; on CUDA it has none), compiled none at all; the trainer's step decision
    reads one value (is the gradient finite); an expiry step reads every level's dead-code flags once, then the
    library reads each level that has one twice."""
    from benchmarks.host_syncs import count_host_syncs, step_report

    for compiled in (False, True):
        model = small_codec(dead_code_threshold=2.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        x = torch.randn(4, 16, 12)
        # no kernel profile: the same graphs as the other tests' (inductor's cache serves them), the same syncs
        report = step_report(model, x, optimizer, scaler, compiled=compiled, kernel_profile=False)
        if compiled:  # a dispatch mode turns torch.compile off: the profiler counts
            assert report["profiler"]["syncs_by_op"] == {"aten::is_nonzero": 1}, report["profiler"]
        else:
            assert report["syncs_step"] == 1 and all(
                "step_guard" in where or "gumbel_sample" in where for where in report["syncs_by_caller"])
            assert report["profiler"]["syncs"] == report["syncs_model"] + 1
        out = model(x)
        with count_host_syncs() as expiry:
            levels = model.expire_dead_codes(out.latent, out.codes)
        assert levels > 0 and expiry.total == 1 + 2 * levels, expiry.by_caller


def test_the_dropout_depth_comes_from_the_seed_with_one_graph_per_depth():
    model = small_codec(quantize_dropout=True)
    seeds = dropout_variants(model)
    assert len(seeds) == 3  # depths 0, 1, 2 of 3 levels
    x = torch.randn(2, 16, 12)
    model.init_codebooks(torch.randn(8, 16, 12), batch_frames=32)
    depths = set()
    for step in range(40):  # any seed maps to the seed of its depth: the same codes on every rank, no collective
        seed = model._dropout_seed(1234 * 1_000_003 + step)
        assert seed in seeds
        with torch.no_grad():
            codes = model(x, dropout_seed=seed).codes
        depths.add(int((codes[0, 0] >= 0).sum()))
    assert depths == {1, 2, 3}


def test_auto_compiles_on_a_gpu_and_on_a_cpu_only_for_a_long_run(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_mode("auto", cuda, steps=10)[0] == "default"
    assert compile_mode("auto", cpu, steps=CPU_COMPILE_MIN_STEPS - 1)[0] is None
    assert compile_mode("auto", cpu, steps=CPU_COMPILE_MIN_STEPS)[0] == "default"
    assert compile_mode("auto", cpu, minutes=10)[0] == "default"
    assert compile_mode("auto", cpu, minutes=1)[0] is None
    assert compile_mode("auto", cpu, steps=100000, minutes=0.05)[0] is None  # either bound short: eager
    assert compile_mode("off", cuda)[0] is None and compile_mode("on", cpu, steps=3)[0] == "default"
    assert compile_mode("cudagraphs", cuda)[0] == "cudagraphs"
    with pytest.raises(BadInputError, match="needs a GPU"):
        compile_mode("cudagraphs", cpu)
    monkeypatch.setenv("CXX", "no-such-compiler")
    mode, why = compile_mode("auto", cpu, minutes=10)
    assert mode is None and "no C++ compiler" in why


@pytest.mark.long
@pytest.mark.timeout(420)
def test_the_compiled_trainer_resumes_bit_for_bit(tmp_path, small_data):
    """Dead codes expired every 3 steps, a NaN loss at step 5 skipped, and a compiled run resumed from the step-7
    checkpoint of an unbroken one (a stop's checkpoint is the same save: test_stops.py): it ends bit for bit where
    the unbroken compiled run does. (That compiled steps follow eager ones through expiry and a skipped step:
    test_compiled_equals_eager_through_expiry_and_a_skipped_step; a graph for each segment length: the two-rank
    test below; a multi-length run's resume: test_stops.py, test_stop_and_resume_gives_identical_weights.)"""
    common = ["--data_dir", small_data, *TINY, "--max_steps", "14", "--eval_every", "7", "--save_every", "7",
              "--dead_code_every", "3", "--refit_iters", "0"]
    whole_run = tmp_path / "compiled"
    r = run_trainer([*common, "--compile", "on", "--output_dir", whole_run], extra_env={"RVQ_FAULT": "nan:step=5"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compile: the training step for segment length" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("1 graph(s), 0 graph break(s)") == 1, r.stderr[-3000:]
    resumed_run = tmp_path / "resumed"
    r = run_trainer([*common, "--compile", "on", "--output_dir", resumed_run,
                     "--resume", whole_run / "checkpoints" / "step_00000007.pt"])
    assert r.returncode == 0 and "at step 7" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("1 graph(s), 0 graph break(s)") == 1, r.stderr[-3000:]  # compiled again, as unbroken

    assert [e["step"] for e in events(whole_run, "skipped_step")] == [6]
    whole, resumed = (newest_checkpoint(run)["model"] for run in (whole_run, resumed_run))
    assert newest_checkpoint(resumed_run)["step"] == 14
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=0, msg=key)


@pytest.mark.long
@pytest.mark.timeout(420)
def test_the_compiled_trainer_on_two_ranks_agrees_with_eager_and_names_a_peer_killed_inside_the_step(tmp_path,
                                                                                                      small_data):
    """Two ranks under --compile on, two segment lengths. The library all-reduces its EMA statistics inside the
    forward: each rank compiles one graph a length with the reduction inside it (no break); the ranks' codebooks
    agree at every step's sync check; the step-4 checkpoint is eager's within float noise. Then rank 1 stalls and is
    SIGKILLed while rank 0 waits in that all-reduce inside the compiled graph: rank 0's error comes in the
    compiler's words, which name no collective; it is judged by which peers are alive: exit 3, rank 1 named (by
    that judgment, or by the watchdog first while rank 0's main thread is still blocked in the all-reduce). The
    same command, launched again, resumes from step 4, compiles again and ends cleanly where eager does."""
    sync_timeout = 10
    common = ["--data_dir", small_data, *TINY, "--max_steps", "8", "--save_every", "4", "--eval_every", "100",
              "--sync_check_every", "1", "--sync_timeout", str(sync_timeout), "--refit_iters", "0",
              "--multi_length_training", "--segment_lengths", "16,32"]
    eager_out, out = tmp_path / "eager", tmp_path / "compiled"
    eager = Ranks([*common, "--compile", "off", "--output_dir", eager_out], log_dir=tmp_path / "eager_logs")
    try:
        assert eager.wait(timeout=200) == [0, 0], eager.output(0) + eager.output(1)
    finally:
        eager.close()
    job = Ranks([*common, "--compile", "on", "--output_dir", out], log_dir=tmp_path / "logs",
                extra_env={"RVQ_FAULT": "stall:rank=1:step=6:seconds=120"})
    try:
        job.wait_for(1, "stalls in data at step 6", timeout=240)
        job.wait_blocked(0, timeout=120)  # in step 6's forward, the compiled graph, waiting for rank 1's part (a
        # compile there first, on a busy machine, can take longer than any fixed wait)
        job.procs[1].kill()
        killed = time.monotonic()
        codes = job.wait(timeout=sync_timeout + 30, ranks=[0])
        logs = [job.output(0), job.output(1)]
    finally:
        job.close()
    assert codes[0] == 3 and job.ended[0] - killed <= sync_timeout + 10, logs[0]
    # named by the main thread's error path or by the watchdog, whichever sees the lost peer first
    assert re.search(r"rank 0 (stopping )?at step 6 \(forward\): ", logs[0]), logs[0]
    assert "rank(s) [1] lost: the process is gone" in logs[0], logs[0]
    assert "training failed" not in logs[0]

    # steps 1-5 trained and every sync check passed (a failed one ends the run with exit 3 at once)
    assert [e["step"] for e in events(out, "train")][:5] == [1, 2, 3, 4, 5]
    assert not any("sync check at step" in log for log in logs), logs
    lengths = {e["segment_length"] for e in events(out, "train")[:5]}
    assert lengths == {16, 32}, lengths  # both lengths drawn (the run's seed is fixed), so both compiled
    assert logs[0].count("compile: compiling the training step for segment length") == 2, logs[0][-3000:]
    assert logs[0].count("1 graph(s), 0 graph break(s)") == 2, logs[0][-3000:]  # (rank 1 logs warnings only)
    compiled = load_checkpoint(out / "checkpoints" / "step_00000004.pt")["model"]
    want = load_checkpoint(eager_out / "checkpoints" / "step_00000004.pt")["model"]
    for key in want:
        torch.testing.assert_close(compiled[key], want[key], rtol=STEP_RTOL, atol=STEP_ATOL, msg=key)

    again = Ranks([*common, "--compile", "on", "--output_dir", out], log_dir=tmp_path / "again_logs")
    try:
        codes = again.wait(timeout=200)
        logs = [again.output(0), again.output(1)]
    finally:
        again.close()
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"resumed from {out}/checkpoints/step_00000004.pt at step 4" in logs[0], logs[0][-3000:]
    compiles = logs[0].count("compile: compiling the training step for segment length")  # the lengths drawn
    assert compiles >= 1 and logs[0].count("1 graph(s), 0 graph break(s)") == compiles, logs[0][-3000:]
    assert events(out, "stop")[-1] == {**events(out, "stop")[-1], "step": 8, "reason": "max_steps"}
    compiled = newest_checkpoint(out)
    want = newest_checkpoint(eager_out)
    assert compiled["step"] == want["step"] == 8
    for key in want["model"]:
        torch.testing.assert_close(compiled["model"][key], want["model"][key], rtol=STEP_RTOL, atol=STEP_ATOL,
                                   msg=key)


def test_under_cuda_graphs_a_graphs_first_call_updates_the_codebooks_once():
    """Inductor's CUDA graphs run a graph twice at its first call (a warm-up, then the capture's replay), so the
    library's EMA update inside the graph would land twice in that step. With a stand-in that does the same on a
    CPU, every training forward leaves the quantizer and the loss as one eager forward does."""
    import copy

    model = small_codec()
    x = torch.randn(4, 16, 12)
    model.init_codebooks(torch.randn(8, 16, 12), batch_frames=64)
    eager = copy.deepcopy(model)
    calls = []

    def first_call_runs_twice(*args):  # inductor's cudagraphify_impl: warm-up run, capture, replay
        if not calls:
            model._forward(*args)
        calls.append(args)
        return model._forward(*args)

    model.compile_training("default")
    model._compiled_step.forward, model._compiled_step.cuda_graphs = first_call_runs_twice, True
    for step in range(3):
        out, want = model(x), eager(x)
        torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0, msg=f"step {step}")
        torch.testing.assert_close(model.quantizer_buffers(), eager.quantizer_buffers(), rtol=0, atol=0,
                                   msg=f"step {step}")
    assert len(calls) == 4  # the first forward's graph was called twice, once to be captured


def test_cudagraphs_on_a_cpu_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    r = run_trainer([*TINY, "--max_steps", "3", "--compile", "cudagraphs", "--output_dir", out], timeout=120)
    assert r.returncode == 2 and "--compile cudagraphs needs a GPU" in r.stderr, r.stderr[-2000:]
    assert not out.exists()


REPLAY_PROXY = """
import sys, torch
from models.codec import RVQCodec
from models.compiled_step import CompiledStep

def compile_training(self, mode="default", variants=1):
    # CUDA graphs' contract without a GPU: the next replay overwrites the last one's outputs, so poison them
    last = []
    def replay(*args):
        with torch.no_grad():
            for t in last:
                t.fill_(-1 if not t.is_floating_point() else float("nan"))
        out = self._forward(*args)
        last[:] = [t for t in out if isinstance(t, torch.Tensor)]
        return out
    self._compiled_step = CompiledStep(self, replay)

RVQCodec.compile_training = compile_training
import rvq_seamless_gpu_cache_nccl as trainer

sys.exit(trainer.main(sys.argv[1:]))
"""


@pytest.mark.timeout(240)
def test_the_trainer_reads_a_steps_outputs_before_the_next_forward(tmp_path, small_data):
    """Under CUDA graphs a replay's outputs live until the next replay. The trainer with a forward that poisons
    its last outputs when called again (gradient accumulation: two forwards a step; expiry every 2 steps)
    logs the same losses and ends with the same weights as with the plain forward."""
    from tests.helpers import env, run_python

    common = ["--data_dir", small_data, *TINY, "--max_steps", "8", "--grad_accum", "2", "--dead_code_every", "2",
              "--eval_every", "4", "--refit_iters", "0", "--compile", "on"]
    plain = run_trainer([*common, "--compile", "off", "--output_dir", tmp_path / "plain"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    proxy = run_python(["-c", REPLAY_PROXY, *common, "--output_dir", tmp_path / "proxy"], timeout=220, env=env())
    assert proxy.returncode == 0, proxy.stderr[-3000:]
    assert [e["loss"] for e in events(tmp_path / "proxy", "train")] == \
        [e["loss"] for e in events(tmp_path / "plain", "train")]
    a, b = (newest_checkpoint(tmp_path / run)["model"] for run in ("plain", "proxy"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
