"""A randomized Hadamard rotation over head_dim, applied per token before quantization (`rotation="hadamard"`).

    R = H_D · diag(s) / sqrt(D)      H_D: the Sylvester Hadamard matrix (entries ±1), s: a seeded ±1 vector

R is orthogonal (R Rᵀ = I), so a token x [D] is stored as x R and read back as (x R) Rᵀ. Mixing the channels of a
token spreads an outlier channel over all D channels: what a per-channel key group or a per-token value group
then sees is close to i.i.d. Gaussian, with a much smaller max/σ ratio, which min-max quantization rewards
(QuaRot, QuIP#). D must be a power of two (Sylvester's construction); other head dims raise.

One matrix serves every layer of a cache (same seed for all layers: `rotation_seed`), held once per device by a
`SharedRotation` and counted once in `QuantCache.memory().rotation` (D·D·4 bytes).

Example:
    >>> R = hadamard_rotation(8, seed=0)
    >>> bool(torch.allclose(R @ R.T, torch.eye(8), atol=1e-6))
    True
"""

from __future__ import annotations

import math

import torch

from .config import ROTATIONS

__all__ = ["ROTATIONS", "hadamard_rotation", "check_rotation_dim", "SharedRotation"]


def check_rotation_dim(head_dim: int) -> None:
    """Raise unless `head_dim` is a power of two (what a Sylvester Hadamard matrix needs)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        allowed = [2**i for i in range(3, 10)]
        raise ValueError(f"rotation='hadamard' needs head_dim to be a power of two; this model has head_dim="
                         f"{head_dim} (allowed: powers of two such as {allowed}; or rotation='none')")


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
    """R = H_D · diag(s) / sqrt(D) [D, D] float32, s = ±1 drawn from a torch.Generator seeded with `seed`
    (deterministic on every device: built on CPU in float64, then cast and moved)."""
    check_rotation_dim(head_dim)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    r = _hadamard(head_dim) * signs[None, :] / math.sqrt(head_dim)
    return r.to(torch.float32).to(device) if device is not None else r.to(torch.float32)


class SharedRotation:
    """The rotation matrix of one cache, shared by its layers: built on a device the first time a layer there asks
    for it (`on`), so a cache holds one [D, D] fp32 matrix per device its layers live on, and nothing else."""

    def __init__(self, head_dim: int, seed: int = 0):
        check_rotation_dim(head_dim)
        self.head_dim, self.seed = head_dim, seed
        self.matrices: dict[str, torch.Tensor] = {}  # str(device) -> [D, D] fp32

    def on(self, device: torch.device | str) -> torch.Tensor:
        key = str(torch.device(device))
        if key not in self.matrices:
            self.matrices[key] = hadamard_rotation(self.head_dim, self.seed, device)
        return self.matrices[key]

    def nbytes(self) -> int:
        return sum(m.untyped_storage().nbytes() for m in self.matrices.values())
