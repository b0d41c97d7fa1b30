"""A randomized Hadamard rotation over head_dim, applied per token before quantization (`rotation="hadamard"`).

    R = blockdiag(H_b, ..., H_b) · diag(s) / sqrt(b)      H_b: the b x b Sylvester Hadamard matrix (entries ±1),
                                                          s: a seeded ±1 vector over all D channels

b (`rotation_block(D)`) is the largest power of two that divides the head dim D, and the block-diagonal matrix holds
D / b copies of H_b. For a power-of-two D, b = D: one block, R = H_D · diag(s) / sqrt(D). Other head dims need
b >= 8, i.e. D a multiple of 8 (80 -> 5 blocks of 16, 96 -> 3 of 32, 120 -> 15 of 8); anything else raises.

R is orthogonal (R Rᵀ = I), so a token x [D] is stored as x R and read back as (x R) Rᵀ. Mixing the channels of a
token spreads an outlier channel over the channels it is mixed with: what a per-channel key group or a per-token
value group then sees is closer to i.i.d. Gaussian, with a smaller max/σ ratio, which min-max quantization rewards
(QuaRot, QuIP#). Mixing happens only within each block of b consecutive channels (all D channels when D is a power
of two): an outlier is spread over its own block of b channels, not over the whole head, so a head dim with a small
b (120: blocks of 8) gets less of the benefit than a power-of-two one. The signs s still span all D channels.

One matrix serves every layer of a cache (same seed for all layers: `rotation_seed`), held once per device by a
`SharedRotation` as a dense [D, D] matrix (zeros off the blocks) and counted once in `QuantCache.memory().rotation`
(D·D·4 bytes).

Example:
    >>> R = hadamard_rotation(8, seed=0)
    >>> bool(torch.allclose(R @ R.T, torch.eye(8), atol=1e-6))
    True
    >>> rotation_block(96), rotation_block(128)
    (32, 128)
"""

from __future__ import annotations

import math

import torch

from .config import ROTATIONS

__all__ = ["ROTATIONS", "hadamard_rotation", "check_rotation_dim", "rotation_block", "SharedRotation"]

MIN_BLOCK = 8  # the smallest Hadamard block allowed: head_dim must be a multiple of 8


def rotation_block(head_dim: int) -> int:
    """The size b of the rotation's Hadamard blocks: the largest power of two dividing `head_dim` (head_dim itself
    when it is a power of two). Raises (`check_rotation_dim`) unless head_dim is a positive multiple of 8."""
    check_rotation_dim(head_dim)
    return head_dim & -head_dim


def check_rotation_dim(head_dim: int) -> None:
    """Raise unless `head_dim` is a positive multiple of 8 (Hadamard blocks of at least 8 channels)."""
    if head_dim < MIN_BLOCK or head_dim % MIN_BLOCK:
        allowed = [64, 80, 96, 112, 128, 256]
        raise ValueError(f"rotation='hadamard' needs head_dim to be a multiple of {MIN_BLOCK}; this model has head_dim="
                         f"{head_dim} (allowed: multiples of {MIN_BLOCK} such as {allowed}; or rotation='none')")


def _hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries ±1), float64."""
    try:
        from scipy.linalg import hadamard
    except ImportError:  # Sylvester's construction: H_2n = [[H, H], [H, -H]]
        h = torch.ones(1, 1, dtype=torch.float64)
        base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.kron(base, h)
        return h
    return torch.from_numpy(hadamard(n).astype("float64"))


def hadamard_rotation(head_dim: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """R = blockdiag(H_b, ..., H_b) · diag(s) / sqrt(b) [D, D] float32, b = `rotation_block(D)` (b = D for a power of
    two: R = H_D · diag(s) / sqrt(D)), s = ±1 over all D channels drawn from a torch.Generator seeded with `seed`
    (deterministic on every device: built on CPU in float64, then cast and moved)."""
    block = rotation_block(head_dim)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    h = _hadamard(block)
    if block < head_dim:
        h = torch.block_diag(*[h] * (head_dim // block))
    r = h * signs[None, :] / math.sqrt(block)
    return r.to(torch.float32).to(device) if device is not None else r.to(torch.float32)


class SharedRotation:
    """The rotation matrices of one cache, shared by its layers: built on a device the first time a layer there asks
    for one (`on`), so a cache holds one [D, D] fp32 matrix per device and width its layers use (keys and values of
    different widths, as MiMo-V2-Flash's, take one each), and nothing else. Raises on construction unless head_dim
    is a multiple of 8 (`check_rotation_dim`), and for another width when it is asked for."""

    def __init__(self, head_dim: int, seed: int = 0):
        check_rotation_dim(head_dim)
        self.head_dim, self.seed = head_dim, seed
        self.matrices: dict[tuple[str, int], torch.Tensor] = {}  # (str(device), width) -> [D, D] fp32

    def on(self, device: torch.device | str, head_dim: int | None = None) -> torch.Tensor:
        """The matrix for `head_dim` channels (default: the cache's head_dim) on `device`."""
        key = (str(torch.device(device)), head_dim or self.head_dim)
        if key not in self.matrices:
            self.matrices[key] = hadamard_rotation(key[1], self.seed, device)
        return self.matrices[key]

    def nbytes(self) -> int:
        return sum(m.untyped_storage().nbytes() for m in self.matrices.values())
