"""How much phone information discrete units carry: PNMI, phone purity and cluster purity, as fairseq's
examples/hubert/measure_teacher_quality.py defines them (HuBERT, Hsu et al. 2021, section IV-C), for each RVQ
level alone and for the first k levels taken together as one unit.

Over the frames scored (phone label y, unit z), with p(y, z) their joint distribution:
- phone purity   = sum_z max_y p(y, z): the share of frames whose phone is their unit's most frequent phone
  (fairseq's "ref pur");
- cluster purity = sum_y max_z p(y, z): the share of frames whose unit is their phone's most frequent unit
  (fairseq's "hyp pur");
- PNMI           = I(y; z) / H(y): the share of the phone entropy the units explain (fairseq's "MI/H(ref)"),
  1 when the units determine the phone, 0 when they say nothing of it.

Computed from the nonzero cells of the joint counts only (quality_from_cells, the one definition), in natural logs
with no epsilon (fairseq adds 1e-8 inside its logs, which moves its figures in the 8th decimal). unit_quality makes
no dense phones x units table (the joint unit of k levels takes up to one value per frame); the trainer's final
eval sums a dense table per level, [phones, codebook size], across ranks and scores it with quality_from_counts.
PNMI is None when the labels hold a single phone (H(y) = 0).
"""
from __future__ import annotations

import numpy as np


def dense_ids(values: np.ndarray) -> tuple[np.ndarray, int]:
    """(each value's index among the distinct values, how many there are)."""
    distinct, inverse = np.unique(np.asarray(values).reshape(-1), return_inverse=True)
    return inverse.astype(np.int64), len(distinct)


def joint_units(codes: np.ndarray, k: int) -> np.ndarray:
    """The unit that levels 1..k of `codes` [frames, levels] form together: one id per distinct tuple of their
    codes (ids numbered level by level, so no product of codebook sizes ever overflows)."""
    unit, _ = dense_ids(codes[:, 0])
    for level in range(1, k):
        code, size = dense_ids(codes[:, level])
        unit, _ = dense_ids(unit * size + code)
    return unit


def unit_quality(phones: np.ndarray, units: np.ndarray) -> dict:
    """{"pnmi", "phone_purity", "cluster_purity"} of `units` against `phones`, one of each per frame (any integer
    or string labels)."""
    if len(phones) != len(units):
        raise ValueError(f"{len(phones)} phone labels for {len(units)} units")
    y, n_phones = dense_ids(phones)
    z, n_units = dense_ids(units)
    cells, counts = np.unique(y * n_units + z, return_counts=True)
    return quality_from_cells(cells // n_units, cells % n_units, counts, n_phones, n_units)


def quality_from_counts(counts: np.ndarray) -> dict:
    """unit_quality from a dense table of joint counts [phones, units] (frames of phone y given unit z), as the
    trainer's final eval sums it over ranks (models/metrics.py EvalSums); rows and columns of zeros count for
    nothing."""
    counts = np.asarray(counts)
    phone, unit = np.nonzero(counts)
    return quality_from_cells(phone, unit, counts[phone, unit], *counts.shape)


def quality_from_cells(phone: np.ndarray, unit: np.ndarray, count: np.ndarray, n_phones: int, n_units: int) -> dict:
    """The one definition: the measures from the nonzero cells of the joint counts, each cell (phone id, unit id,
    frames), ids below n_phones and n_units."""
    count = np.asarray(count, dtype=np.float64)  # whole numbers: exact in float64 up to 2^53 frames
    total = float(count.sum())
    if total == 0:
        raise ValueError("no frames to score")
    phone_count = np.bincount(phone, weights=count, minlength=n_phones)
    unit_count = np.bincount(unit, weights=count, minlength=n_units)
    p = count / total
    mutual = float((p * np.log(count * total / (phone_count[phone] * unit_count[unit]))).sum())
    phone_p = phone_count[phone_count > 0] / total
    phone_entropy = float(-(phone_p * np.log(phone_p)).sum())
    best_phone_of_unit = np.zeros(n_units)
    np.maximum.at(best_phone_of_unit, unit, count)
    best_unit_of_phone = np.zeros(n_phones)
    np.maximum.at(best_unit_of_phone, phone, count)
    return {"pnmi": max(0.0, mutual) / phone_entropy if phone_entropy > 0 else None,
            "phone_purity": float(best_phone_of_unit.sum()) / total,
            "cluster_purity": float(best_unit_of_phone.sum()) / total}


def phone_information(phones: np.ndarray, codes: np.ndarray) -> list[dict]:
    """Per level of `codes` [frames, levels] (one phone label per row in `phones`): its unit_quality alone, and
    that of levels 1..k together as `joint_pnmi`, `joint_phone_purity`, `joint_cluster_purity`, with the number of
    distinct units they form (`joint_units`)."""
    out = []
    for k in range(1, codes.shape[1] + 1):
        alone = unit_quality(phones, codes[:, k - 1])
        units = joint_units(codes, k)
        joint = alone if k == 1 else unit_quality(phones, units)
        out.append({**alone, **{f"joint_{key}": value for key, value in joint.items()},
                    "joint_units": int(units.max()) + 1 if len(units) else 0})
    return out
