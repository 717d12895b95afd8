"""Evaluation metrics from sums that ranks can all-reduce (never per-frame outputs).

rel_mse = sum ||x - x_hat||^2 / sum ||x - mean(x)||^2, mean cosine similarity,
per-level code usage and perplexity, and bits per frame; given each code frame's phone label, per level
PNMI, phone purity and cluster purity from a joint count table [levels, phones, codebook size] that sums
across ranks like the rest (models/unit_quality.py).
"""
from __future__ import annotations

import math

import torch

from models.unit_quality import quality_from_counts


class EvalSums:
    """Running sums over evaluated frames; `vector()` packs them for one all-reduce. phones: how many phone ids
    the labels given to add() take (0: no labels, no phone measures); every rank must give the same."""

    def __init__(self, feature_dim: int, num_quantizers: int, codebook_size: int, device, phones: int = 0):
        f64 = dict(dtype=torch.float64, device=device)
        self.dim, self.levels, self.size = feature_dim, num_quantizers, codebook_size
        self.sq_error = torch.zeros((), **f64)
        self.sum_x = torch.zeros(feature_dim, **f64)
        self.sum_x2 = torch.zeros(feature_dim, **f64)
        self.cosine = torch.zeros((), **f64)
        self.frames = torch.zeros((), **f64)
        self.histogram = torch.zeros(num_quantizers, codebook_size, **f64)
        self.phones = phones
        self.joint = torch.zeros(num_quantizers, phones, codebook_size, **f64) if phones else None

    @torch.no_grad()
    def add(self, x: torch.Tensor, x_hat: torch.Tensor, codes: torch.Tensor,
            labels: torch.Tensor | None = None) -> None:
        """labels: the phone id of each code frame (codes' shape without the levels), with `phones` only."""
        x, x_hat = x.double().flatten(0, -2), x_hat.double().flatten(0, -2)
        self.sq_error += ((x - x_hat) ** 2).sum()
        self.sum_x += x.sum(0)
        self.sum_x2 += (x**2).sum(0)
        self.cosine += torch.nn.functional.cosine_similarity(x, x_hat, dim=-1).sum()
        self.frames += x.shape[0]
        codes = codes.flatten(0, -2)
        if self.joint is not None:
            labels = labels.reshape(-1).to(codes.device)
        for level in range(self.levels):
            c = codes[:, level]
            used = c >= 0
            self.histogram[level] += torch.bincount(c[used], minlength=self.size).double()
            if self.joint is not None:
                cells = labels[used] * self.size + c[used]
                self.joint[level] += torch.bincount(cells, minlength=self.phones * self.size).double().view(
                    self.phones, self.size)

    def vector(self) -> torch.Tensor:
        parts = [self.sq_error[None], self.sum_x, self.sum_x2, self.cosine[None], self.frames[None], self.histogram.flatten()]
        return torch.cat(parts + ([self.joint.flatten()] if self.joint is not None else []))

    def load_vector(self, v: torch.Tensor) -> None:
        d, i = self.dim, 0
        self.sq_error = v[i]; i += 1
        self.sum_x = v[i : i + d]; i += d
        self.sum_x2 = v[i : i + d]; i += d
        self.cosine = v[i]; i += 1
        self.frames = v[i]; i += 1
        self.histogram = v[i : i + self.levels * self.size].view(self.levels, self.size); i += self.levels * self.size
        if self.joint is not None:
            self.joint = v[i:].view(self.levels, self.phones, self.size)

    def result(self, downsample: int) -> dict:
        n = float(self.frames)
        if n == 0:
            raise ValueError("no frames were evaluated")
        mean = self.sum_x / n
        total_var = float((self.sum_x2 - n * mean**2).sum())
        probs = self.histogram / self.histogram.sum(1, keepdim=True).clamp_min(1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(1)
        result = {
            "rel_mse": float(self.sq_error) / max(total_var, 1e-12),
            "cosine": float(self.cosine) / n,
            "code_usage": [round(float(u), 4) for u in (self.histogram > 0).double().mean(1)],
            "perplexity": [round(float(p), 2) for p in entropy.exp()],
            "bits_per_frame": self.levels * math.log2(self.size) / downsample,
            "frames": int(n),
        }
        if self.joint is not None:
            quality = [quality_from_counts(table) for table in self.joint.cpu().numpy()]
            result.update({key: [q[key] for q in quality] for key in ("pnmi", "phone_purity", "cluster_purity")},
                          phones=self.phones)
        return result
