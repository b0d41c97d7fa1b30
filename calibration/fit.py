"""Fit what the cache loads from a calibration file: non-uniform codebooks and static key ranges.

Both are fitted on samples normalised exactly as the cache normalises them at run time:
    keys    per channel over blocks of `k_group_size` tokens (or over the static range), pre-RoPE
    values  per token over groups of `v_group_size` channels
so a sample u lies in [0, 1] of its group's range. Each sample is weighted by its sensitivity times the square of
its group's range (the error in model units is range * (u - level)). With dense-and-sparse outliers the range comes
from the values that stay in the group, and the outliers (kept exactly) get weight 0.
"""

from __future__ import annotations

import torch

from qcache.quant import select_outliers

__all__ = ["weighted_lloyd", "key_samples", "value_samples", "fit_codebook", "fit_static_key_range",
           "CLIP_CANDIDATES"]

# fractions of the per-channel distribution clipped at each end, tried when fitting static key ranges
CLIP_CANDIDATES = (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)


def weighted_lloyd(u: torch.Tensor, w: torch.Tensor, levels: int, iters: int = 30) -> torch.Tensor:
    """1-D weighted k-means (Lloyd) on u in [0, 1] with the end levels fixed at 0 and 1; returns sorted levels."""
    if levels < 2:
        raise ValueError(f"levels={levels} must be >= 2")
    u, w = u.double().flatten(), w.double().flatten()
    c = torch.linspace(0, 1, levels, dtype=torch.float64)
    for _ in range(iters):
        idx = torch.bucketize(u, (c[1:] + c[:-1]) / 2)
        wsum = torch.zeros(levels, dtype=torch.float64).scatter_add_(0, idx, w)
        usum = torch.zeros(levels, dtype=torch.float64).scatter_add_(0, idx, w * u)
        new = torch.where(wsum > 0, usum / wsum.clamp(min=1e-300), c)
        new[0], new[-1] = 0.0, 1.0
        new, _ = new.sort()
        if torch.allclose(new, c, atol=1e-7):
            break
        c = new
    return c.float()


def _subsample(u: torch.Tensor, w: torch.Tensor, max_samples: int, gen: torch.Generator):
    u, w = u.flatten(), w.flatten()
    if u.numel() > max_samples:
        keep = torch.randperm(u.numel(), generator=gen)[:max_samples]
        u, w = u[keep], w[keep]
    return u, w


def _normalise(x: torch.Tensor, dim: int, outliers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped x (groups along `dim`) -> (u in [0, 1] of each group's range, range, keep mask)."""
    if outliers:
        _, _, keep = select_outliers(x.movedim(dim, -1).flatten(0, -2), outliers, x.shape[dim], dim=-1)
        keep = keep.view(*x.movedim(dim, -1).shape).movedim(-1, dim)
    else:
        keep = torch.ones_like(x, dtype=torch.bool)
    lo = x.masked_fill(~keep, float("inf")).amin(dim, keepdim=True)
    hi = x.masked_fill(~keep, float("-inf")).amax(dim, keepdim=True)
    rng = (hi - lo).clamp(min=1e-12)
    return ((x - lo) / rng).clamp(0, 1), rng, keep


def key_samples(keys: torch.Tensor, k_weight: torch.Tensor, group_size: int,
                static: tuple[torch.Tensor, torch.Tensor] | None = None, outliers: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [H, N, D] pre-RoPE, k_weight [H, D] -> normalised samples u and weights w (same shape)."""
    H, N, D = keys.shape
    if static is not None:
        zero, rng = static  # [H, D]
        u = ((keys - zero[:, None]) / rng[:, None]).clamp(0, 1)
        w = (k_weight * rng.pow(2))[:, None, :].expand_as(u)
        return u, w
    n = N // group_size * group_size
    x = keys[:, :n].reshape(H, n // group_size, group_size, D)  # [H, blocks, G, D]
    u, rng, keep = _normalise(x, 2, outliers)
    w = (k_weight[:, None, None, :] * rng.pow(2)) * keep
    return u, w


def value_samples(values: torch.Tensor, v_weight: torch.Tensor, group_size: int, outliers: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """values [H, N, D], v_weight [H, N] -> normalised samples u and weights w."""
    H, N, D = values.shape
    x = values.reshape(H, N, D // group_size, group_size)  # [H, N, groups, g]
    u, rng, keep = _normalise(x, 3, outliers)
    w = (v_weight[:, :, None, None] * rng.pow(2)) * keep
    return u, w


def fit_codebook(u: torch.Tensor, w: torch.Tensor, bits: int, max_samples: int = 400_000,
                 seed: int = 0) -> torch.Tensor:
    """Sensitivity-weighted k-means levels (2**bits, sorted, ends at 0 and 1) for normalised samples."""
    gen = torch.Generator().manual_seed(seed)
    u, w = _subsample(u, w, max_samples, gen)
    return weighted_lloyd(u, w, 2**bits)


def fit_static_key_range(keys: torch.Tensor, bits: int, candidates=CLIP_CANDIDATES, max_tokens: int = 16384,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, channel) clipped range [zero, zero + range] of pre-RoPE keys [H, N, D] minimising the squared
    error of uniform `bits`-bit quantization with clamping. Returns (zero, range), each [H, D]."""
    H, N, D = keys.shape
    if N > max_tokens:
        keep = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:max_tokens]
        keys = keys[:, keep]
    qmax = 2**bits - 1
    n = keys.shape[1]
    ordered = keys.sort(dim=1).values  # [H, N, D]: quantiles by index, once
    best_err = torch.full((H, D), float("inf"))
    best_lo, best_rng = torch.zeros(H, D), torch.ones(H, D)
    for p in candidates:
        k = min(int(p * (n - 1)), (n - 1) // 2)
        lo, hi = ordered[:, k], ordered[:, n - 1 - k]  # [H, D]
        rng = (hi - lo).clamp(min=1e-6)
        step = rng / qmax
        q = ((keys - lo[:, None]) / step[:, None]).round().clamp(0, qmax)
        err = (q * step[:, None] + lo[:, None] - keys).pow(2).mean(1)  # [H, D]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo = torch.where(better, lo, best_lo)
        best_rng = torch.where(better, rng, best_rng)
    return best_lo, best_rng
