"""training/optimizer.py: Muon's step against torch.optim.Muon's (the same update for 2-D weights, the step scaled
to AdamW's size), a conv kernel moved as its [out, in * k] matrix, kernels of one shape stepped together as each
alone, the biases stepped as by AdamW alone, and a state dict that resumes to the bytes of an unbroken run."""
import copy

import pytest
import torch

from training.optimizer import NS_COEFFICIENTS, NS_STEPS, Muon, MuonAdamW, build_optimizer, gram_form_is_cheaper, \
    orthogonalized

pytestmark = pytest.mark.timeout(60)


def steps(params: list[torch.Tensor], optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()


def grads_for(shapes, n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(n)]


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 8, 3)], ids=["wide", "tall", "conv kernel"])
def test_a_weight_moves_as_torch_muon_moves_its_matrix(shape):
    """torch.optim.Muon with adjust_lr_fn="match_rms_adamw" on the [shape[0], rest] matrix: the same steps (torch
    orthogonalises in bfloat16, so to bfloat16's precision)."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(shape, generator=gen)
    ours = start.clone().requires_grad_()
    theirs = start.reshape(shape[0], -1).clone().requires_grad_()
    grads = grads_for([shape], 3)
    steps([ours], Muon([ours], lr=0.02, weight_decay=0.1), grads)
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    steps([theirs], reference, [[g.reshape(shape[0], -1)] for (g,) in grads])
    moved = ours.detach().reshape(shape[0], -1) - start.reshape(shape[0], -1)
    expected = theirs.detach() - start.reshape(shape[0], -1)
    assert moved.abs().max() > 0.01
    torch.testing.assert_close(moved, expected, rtol=0, atol=0.02 * expected.abs().max().item())


def test_the_newton_schulz_iteration_brings_every_singular_value_near_one():
    x = torch.randn(5, 32, 96, generator=torch.Generator().manual_seed(2)) * 7
    s = torch.linalg.svdvals(orthogonalized(x))
    assert s.min() > 0.5 and s.max() < 1.5


def direct_iteration_in_float64(g: torch.Tensor) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    x = g.double()
    x = x / torch.linalg.matrix_norm(x, keepdim=True)
    for _ in range(NS_STEPS):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x


@pytest.mark.parametrize("shape", [(3, 32, 96), (2, 32, 128), (4, 32, 32), (2, 96, 32)],
                         ids=["3 columns a row", "4 columns a row", "square", "tall"])
def test_either_form_of_the_iteration_is_the_direct_one_in_float64(shape):
    """The Gram form (wide matrices) and the direct one (the rest) give the direct iteration's result, on
    matrices as ill-conditioned as a momentum of a few directions and noise."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = shape[1:]
    g = torch.randn(shape, generator=gen) + 50 * torch.randn(shape[0], rows, 3, generator=gen) @ torch.randn(
        shape[0], 3, cols, generator=gen)
    wide = g if rows <= cols else g.mT
    expected = direct_iteration_in_float64(wide)
    expected = expected if rows <= cols else expected.mT
    got = orthogonalized(g).double()
    assert (got - expected).norm() / expected.norm() < 1e-3


def test_the_gram_form_is_taken_where_it_makes_fewer_products():
    assert gram_form_is_cheaper(160, 480) and gram_form_is_cheaper(160, 640)
    assert not gram_form_is_cheaper(160, 160) and not gram_form_is_cheaper(160, 240)


def test_kernels_of_one_shape_step_together_as_each_alone():
    shapes = [(16, 8, 3), (16, 8, 3), (16, 16, 1), (16, 8, 3)]
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = grads_for(shapes, 3)
    together = [t.clone().requires_grad_() for t in start]
    steps(together, Muon(together, lr=0.01), grads)
    for i, t in enumerate(start):
        alone = t.clone().requires_grad_()
        steps([alone], Muon([alone], lr=0.01), [[g[i]] for g in grads])
        torch.testing.assert_close(together[i].detach(), alone.detach(), rtol=1e-6, atol=1e-6)


def model_params(seed: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in [(16, 8, 3), (16,), (16, 16, 1), (16,)]]


def test_muon_takes_the_kernels_and_adamw_the_biases_as_adamw_alone_would():
    params = model_params()
    optimizer = build_optimizer("muon", params, lr=0.01, weight_decay=0.01, device=torch.device("cpu"))
    assert isinstance(optimizer, MuonAdamW)
    assert [p.ndim for p in optimizer.muon.param_groups[0]["params"]] == [3, 3]
    biases = [p.detach().clone().requires_grad_() for p in params if p.ndim == 1]
    adamw = build_optimizer("adamw", biases, lr=0.01, weight_decay=0.01, device=torch.device("cpu"))
    assert isinstance(adamw, torch.optim.AdamW)
    grads = grads_for([p.shape for p in params], 3)
    for group in optimizer.param_groups:  # the schedule's lr reaches both
        group["lr"] = 0.005
    for group in adamw.param_groups:
        group["lr"] = 0.005
    steps(params, optimizer, grads)
    steps(biases, adamw, [[g for g, p in zip(gs, params) if p.ndim == 1] for gs in grads])
    for ours, alone in zip([p for p in params if p.ndim == 1], biases):
        assert torch.equal(ours, alone)


def scheduled_steps(params, optimizer, grads, first: int) -> None:
    """Steps with the learning rate set on `param_groups` before each, as the trainer's schedule sets it."""
    for step, step_grads in enumerate(grads, start=first):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 / (1 + step)
        steps(params, optimizer, [step_grads])


def test_a_resumed_optimizer_goes_on_to_the_bytes_of_an_unbroken_one():
    """Its state dict saved and loaded into a new one, the schedule's learning rate still reaching both optimizers
    (load_state_dict gives each new param groups)."""
    grads = grads_for([p.shape for p in model_params()], 5)
    unbroken = model_params()
    opt = build_optimizer("muon", unbroken, lr=0.01, weight_decay=0.1, device=torch.device("cpu"))
    scheduled_steps(unbroken, opt, grads, 0)
    broken = model_params()
    opt = build_optimizer("muon", broken, lr=0.01, weight_decay=0.1, device=torch.device("cpu"))
    scheduled_steps(broken, opt, grads[:2], 0)
    state, weights = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in broken]
    resumed = [w.clone().requires_grad_() for w in weights]
    opt = build_optimizer("muon", resumed, lr=0.01, weight_decay=0.1, device=torch.device("cpu"))
    opt.load_state_dict(state)
    scheduled_steps(resumed, opt, grads[2:], 2)
    for a, b in zip(unbroken, resumed):
        assert torch.equal(a, b)


def test_an_adamw_state_is_refused_by_muon_naming_the_flag():
    params = model_params()
    adamw = build_optimizer("adamw", params, lr=0.01, weight_decay=0.0, device=torch.device("cpu"))
    muon = build_optimizer("muon", model_params(), lr=0.01, weight_decay=0.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="--optimizer adamw"):
        muon.load_state_dict(adamw.state_dict())


def test_a_grad_scaler_unscales_and_steps_both_optimizers():
    """fp16's GradScaler goes through `param_groups` and `step`: the scaled gradients, unscaled, give the step of
    the plain ones (a power-of-two scale is exact)."""
    grads = grads_for([p.shape for p in model_params()], 2)
    plain, scaled = model_params(), model_params()
    opt = build_optimizer("muon", plain, lr=0.01, weight_decay=0.0, device=torch.device("cpu"))
    steps(plain, opt, grads)
    opt = build_optimizer("muon", scaled, lr=0.01, weight_decay=0.0, device=torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step_grads in grads:
        scale = scaler.scale(torch.tensor(1.0))  # as the scaled loss's backward would scale the gradients
        for p, g in zip(scaled, step_grads):
            p.grad = g * scale
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    for a, b in zip(plain, scaled):
        assert torch.equal(a, b)
