"""Data-free non-uniform levels (`levels="lloyd-max"`): Lloyd-Max levels for min-max normalized Gaussian groups.

A group (a key channel over `k_group_size` tokens, a value token over `v_group_size` channels) is quantized on its
own [min, max] range, so what the levels see is u = (x - min) / (max - min) in [0, 1]. When the group's entries are
i.i.d. Gaussian (what a Hadamard-rotated group approximately is: qcache/rotation.py) the distribution of u depends
only on the group size n (and on the outliers taken out before the range is set), not on the data: u piles up
around 0.5 and thins out towards the ends, where exactly one entry of each group sits at 0 and one at 1. Uniform
levels waste most of their steps on the thin ends; Lloyd-Max levels put them where the mass is.

How they are computed (deterministic, no data): a fixed-seed Monte-Carlo sample of 2**20 Gaussian values in groups
of n, each group's `outliers` entries farthest from its median removed (as `quant.select_outliers` does) and the
rest normalized by its own min/max; a 2**14-bin histogram of u and of its mirror image 1 - u, each entry weighted by its group's range²
(so that the error minimized is the squared error of x, not of u); then Lloyd iterations on the histogram, from
uniform levels. Should the two extreme levels be pinned at 0 and 1, where every group has an entry? Measured:
no. Mean squared error per entry in units of σ² on held-out Gaussian groups (2**18 values, another seed;
`_heldout_mse`), n = 64, no outliers:

    ====  =======  ==================  ==========================
    bits  uniform  lloyd-max, pinned   lloyd-max, free (used)
    ====  =======  ==================  ==========================
    2     0.2019   0.1824              0.1131 (levels .17 .40 .60 .83)
    3     0.0369   0.0321              0.0285
    4     0.0080   0.0069              0.0067
    ====  =======  ==================  ==========================

Pinning spends two of four 2-bit levels on two entries per group; free levels cost those two entries a larger error
and save it on the other 62. So the levels are fitted free (`pin=False`). Cached per (bits, group, outliers) with `functools.lru_cache`; each
takes about 0.05-0.1 s on one CPU core.

Example:
    >>> [round(v, 2) for v in lloyd_max_levels(2, 64)]
    [0.17, 0.4, 0.6, 0.83]
"""

from __future__ import annotations

import functools

import torch

from .config import LEVELS

__all__ = ["LEVELS", "lloyd_max_levels", "levels_tensor", "gaussian_levels", "gaussian_levels_tensor"]

_SAMPLES = 2**20
_BINS = 2**14
_SEED = 20260
_ITERS = 300


def _normalized_groups(group: int, outliers: int, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u [m, group - outliers] in [0, 1] (float64) of Gaussian groups, and each group's range [m, 1]."""
    gen = torch.Generator().manual_seed(seed)
    m = max(samples // group, 1)
    x = torch.randn(m, group, generator=gen, dtype=torch.float64)
    if outliers:
        centre = x.median(dim=1, keepdim=True).values
        drop = (x - centre).abs().topk(outliers, dim=1).indices
        keep = torch.ones_like(x, dtype=torch.bool).scatter_(1, drop, False)
        x = x[keep].view(m, group - outliers)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    rng = hi - lo
    return (x - lo) / rng, rng


def _lloyd(bits: int, group: int, outliers: int, pin: bool) -> torch.Tensor:
    u, rng = _normalized_groups(group, outliers, _SAMPLES, _SEED)
    weight = (rng**2).expand_as(u).reshape(-1)
    idx = (u.reshape(-1) * _BINS).long().clamp_(0, _BINS - 1)
    hist = torch.zeros(_BINS, dtype=torch.float64).index_add_(0, idx, weight)  # weighted mass per bin
    first = torch.zeros(_BINS, dtype=torch.float64).index_add_(0, idx, weight * u.reshape(-1))  # weighted sum of u
    # the distribution is symmetric about 1/2: add each sample's mirror image 1 - u (exactly symmetric levels, less
    # Monte-Carlo noise)
    hist, first = hist + hist.flip(0), first + hist.flip(0) - first.flip(0)
    L = 2**bits
    levels = torch.linspace(0, 1, L, dtype=torch.float64)
    for _ in range(_ITERS):
        mids = (levels[1:] + levels[:-1]) / 2
        cell = torch.bucketize((torch.arange(_BINS, dtype=torch.float64) + 0.5) / _BINS, mids)
        mass = torch.zeros(L, dtype=torch.float64).index_add_(0, cell, hist)
        total = torch.zeros(L, dtype=torch.float64).index_add_(0, cell, first)
        new = torch.where(mass > 0, total / mass.clamp(min=1e-300), levels)
        if pin:
            new[0], new[-1] = 0.0, 1.0
        new, _ = new.sort()
        if torch.equal(new, levels) or float((new - levels).abs().max()) < 1e-9:
            levels = new
            break
        levels = new
    return levels


@functools.lru_cache(maxsize=None)
def lloyd_max_levels(bits: int, group: int, outliers: int = 0, pin: bool = False) -> tuple[float, ...]:
    """2**bits sorted levels in [0, 1] of a group's [min, max] range (a codebook, see `quant.quantize`) for groups
    of `group` i.i.d. Gaussian entries of which `outliers` are kept aside (`pin`: levels 0 and 1 fixed, measured
    worse). Deterministic; cached."""
    if group - outliers < 2:
        raise ValueError(f"lloyd-max levels need groups of at least 2 quantized entries; got group={group}, "
                         f"outliers={outliers}")
    levels = _lloyd(bits, group, outliers, pin).clamp(0, 1)
    return tuple(float(v) for v in levels.to(torch.float32))


def levels_tensor(bits: int, group: int, outliers: int = 0) -> torch.Tensor:
    """`lloyd_max_levels` as a fresh float32 tensor (each holder gets its own: it is counted where it is held)."""
    return torch.tensor(lloyd_max_levels(bits, group, outliers), dtype=torch.float32)


def _heldout_mse(levels, group: int, outliers: int = 0, samples: int = 2**18, seed: int = 7) -> float:
    """Mean squared error per quantized entry, in units of σ², of Gaussian groups quantized on their own [min, max]
    with `levels` (in [0, 1], sorted) by nearest level: the number the module docstring tabulates."""
    u, rng = _normalized_groups(group, outliers, samples, seed)
    lv = torch.as_tensor(levels, dtype=torch.float64)
    code = torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)
    return float((((lv[code] - u) * rng) ** 2).mean())


@functools.lru_cache(maxsize=None)
def gaussian_levels(bits: int) -> tuple[float, ...]:
    """The 2**bits Lloyd-Max levels of a standard Gaussian (in units of σ, sorted, symmetric about 0): what
    `v_scale="norm"` quantizes a rotated value token divided by its RMS with. Computed without sampling: Lloyd
    iterations with the exact centroid of each cell, (φ(a) - φ(b)) / (Φ(b) - Φ(a)), from the Gaussian's quantiles.
    They match Max (1960): 2 bits ±0.4528, ±1.510; mean squared error 0.1175 / 0.03455 / 0.009501 σ² at 2 / 3 / 4
    bits."""
    L = 2**bits
    levels = torch.special.ndtri((torch.arange(L, dtype=torch.float64) + 0.5) / L)
    inf = torch.tensor([float("inf")], dtype=torch.float64)
    for _ in range(20000):
        edges = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
        pdf = torch.exp(-edges**2 / 2) / (2 * torch.pi) ** 0.5  # 0 at ±inf
        new = (pdf[:-1] - pdf[1:]) / (torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1]))
        done = float((new - levels).abs().max()) < 1e-13
        levels = new
        if done:
            break
    levels = (levels - levels.flip(0)) / 2  # exactly symmetric
    return tuple(float(v) for v in levels)


def gaussian_levels_tensor(bits: int) -> torch.Tensor:
    """`gaussian_levels` as a fresh float32 tensor."""
    return torch.tensor(gaussian_levels(bits), dtype=torch.float32)


def _gaussian_mse(levels) -> float:
    """Mean squared error (σ²) of a standard Gaussian quantized to the nearest of `levels` (numerical integral)."""
    grid = torch.linspace(-10, 10, 2**20 + 1, dtype=torch.float64)
    weight = torch.exp(-grid**2 / 2)
    lv = torch.as_tensor(levels, dtype=torch.float64)
    q = lv[torch.bucketize(grid, (lv[1:] + lv[:-1]) / 2)]
    return float(((grid - q) ** 2 * weight).sum() / weight.sum())
