"""The trainer's optimizer (--optimizer): `adamw` on every parameter, or `muon`, Muon on the codec's conv kernels
and AdamW on the rest (its biases).

Muon (Keller Jordan et al., 2024; torch.optim.Muon is the same update for 2-D weights) replaces a matrix's
momentum by the nearest semi-orthogonal matrix, found by five Newton-Schulz iterations, so that every direction of
the weight moves at the same rate. A conv kernel [out, in, k] is the matrix [out, in * k] (what the conv
multiplies its unfolded input by). Its step is scaled by 0.2 * sqrt(max(rows, cols)), the scale that gives it
AdamW's update size ("match_rms_adamw", Liu et al., 2025), so both kinds of parameter follow one --lr, one
schedule and one --weight_decay. The kernels of one shape are orthogonalised together: the Newton-Schulz products
are batched by shape (three shapes in the default codec), not made kernel by kernel.

`build_optimizer` makes it; the step, its state dict and its resume are those of a torch optimizer: `MuonAdamW`
holds the two and shows their param groups as one list (the learning rate set on each every step).
"""
from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "muon")
BETAS = (0.9, 0.99)  # AdamW's
MOMENTUM = 0.95  # Muon's (Nesterov)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz iteration's, as torch.optim.Muon's
NS_STEPS = 5
RMS_MATCH = 0.2  # Muon's step x 0.2 sqrt(max(rows, cols)): AdamW's update RMS


def gram_form_is_cheaper(rows: int, cols: int) -> bool:
    """Whether NS_STEPS iterations on a [rows, cols] matrix (rows <= cols) take fewer multiply-adds in the Gram
    form: the direct form makes 2 rows^2 cols + rows^3 an iteration; the Gram form 2 rows^2 cols once, 4 rows^3 an
    iteration, 3 rows^3 fewer in all (its first and last iterations skip a product each). So above 1.5 columns a
    row: a [160, 480] kernel takes 23 rows^3 against 35."""
    direct = NS_STEPS * (2 * rows * rows * cols + rows ** 3)
    return 2 * rows * rows * cols + (4 * NS_STEPS - 3) * rows ** 3 < direct


def orthogonalized(g: torch.Tensor) -> torch.Tensor:
    """[n, rows, cols] matrices, each replaced by the nearest semi-orthogonal one (its singular values brought near
    1 by NS_STEPS Newton-Schulz iterations), in float32.

    Each iteration is x <- p(s) x, p(s) = a + b s + c s^2, s = x x^T. Where the matrices are wide enough
    (gram_form_is_cheaper) the iterations run on the [rows, rows] Gram matrix instead: with x = q x0, s = q s0 q^T
    and q <- p(s) q, and x0 is multiplied once, at the end. The same iteration, to float32's precision of the
    squared matrix (within 1e-3 of the direct form, tests/test_optimizer.py)."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    if gram_form_is_cheaper(*x.shape[-2:]):
        s, q = x @ x.mT, None
        for step in range(NS_STEPS):
            p = torch.baddbmm(s, s, s, beta=b, alpha=c)
            p.diagonal(dim1=-2, dim2=-1).add_(a)
            q = p if q is None else p @ q
            if step < NS_STEPS - 1:
                s = p @ s @ p
        x = q @ x
    else:
        for _ in range(NS_STEPS):  # three batched products an iteration
            s = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(s, s, s, beta=b, alpha=c), x, beta=a)
    return x if wide else x.mT


class Muon(torch.optim.Optimizer):
    """Muon for weights of two or more dimensions, each taken as [shape[0], the rest]: Nesterov momentum, its
    orthogonalisation, decoupled weight decay; the step scaled to AdamW's size (RMS_MATCH)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, momentum: float = MOMENTUM):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
            grads = [p.grad for p in params]
            bufs = []
            for p, g in zip(params, grads):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                bufs.append(state["momentum_buffer"])
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads)
            nesterov = torch._foreach_add(grads, bufs, alpha=momentum)
            by_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault(tuple(p.shape), []).append(i)
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            for shape, members in by_shape.items():
                rows, cols = shape[0], nesterov[members[0]].numel() // shape[0]
                stacked = torch.stack([nesterov[i].reshape(rows, cols) for i in members])
                updates = orthogonalized(stacked).to(stacked.dtype).unbind(0)
                torch._foreach_add_([params[i] for i in members], [u.view(shape) for u in updates],
                                    alpha=-lr * RMS_MATCH * max(rows, cols) ** 0.5)


class MuonAdamW:
    """Muon on `matrices`, AdamW on `rest`, stepped as one optimizer: `param_groups` lists both's groups (Muon's
    first), so that the schedule's learning rate and --weight_decay set on each reach both; the state dict holds
    both's. GradScaler unscales and steps it through those."""

    def __init__(self, matrices: list[torch.Tensor], rest: list[torch.Tensor], *, lr: float, weight_decay: float,
                 fused: bool | None, foreach: bool | None):
        self.muon = Muon(matrices, lr=lr, weight_decay=weight_decay)
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=BETAS, weight_decay=weight_decay, fused=fused,
                                       foreach=foreach)

    @property
    def param_groups(self) -> list[dict]:
        """Both's groups, as they are now: load_state_dict gives each optimizer new ones."""
        return [*self.muon.param_groups, *self.adamw.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError("the checkpoint's optimizer state is not Muon's and AdamW's: it was trained with "
                             "--optimizer adamw")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_optimizer(name: str, params: list[torch.Tensor], *, lr: float, weight_decay: float, device: torch.device):
    """--optimizer `name` over the model's `params`: AdamW fused into one kernel over its parameters where torch has
    one (CUDA and CPU), else over lists; Muon (with `muon`) on those of two or more dimensions."""
    fused = device.type in ("cuda", "cpu")
    adamw = {"fused": fused or None, "foreach": None if fused else True}
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=weight_decay, **adamw)
    if name != "muon":
        raise ValueError(f"--optimizer {name}: one of {', '.join(OPTIMIZERS)}")
    matrices = [p for p in params if p.ndim >= 2]
    return MuonAdamW(matrices, [p for p in params if p.ndim < 2], lr=lr, weight_decay=weight_decay, **adamw)
