"""Chunked perplexity: text fed through the cache under test in chunks, so every later chunk attends to what the
cache stored for the earlier ones. A chunk the model did not store in that cache (it built one of its own) raises
`CacheNotWrittenError`: the numbers would be those of another cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from qcache._compat import check_transformers, require_cache_written

__all__ = ["chunked_nll"]


@torch.no_grad()
def chunked_nll(model, input_ids: torch.Tensor, make_cache: Callable[[], object], chunk: int = 256,
                progress: bool = False, desc: str | None = None) -> tuple[float, int]:
    """Summed next-token NLL (nats) and token count of `input_ids` [N, L], fed `chunk` tokens at a time through a
    fresh cache from `make_cache()` (all N sequences as one batch). Raises `CacheNotWrittenError` when a chunk
    does not land in that cache."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    check_transformers()
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    n, length = ids.shape
    cache = make_cache()
    if not callable(getattr(cache, "get_seq_length", None)):
        raise ValueError(f"make_cache() returned {type(cache).__name__}; it must build a transformers Cache "
                         "(e.g. lambda: DynamicCache(config=model.config))")
    held = cache.get_seq_length()
    total, count = 0.0, 0
    starts = range(0, length - 1, chunk)
    for start in tqdm(starts, desc=desc or "chunks", disable=not progress, leave=False):
        piece = ids[:, start:start + chunk]  # [N, c]
        logits = model(piece, cache=cache, use_cache=True).logits.float()  # [N, c, V]
        held = require_cache_written(cache, held, piece.shape[1], f"chunk at token {start}")
        targets = ids[:, start + 1:start + chunk + 1]  # [N, c'] with c' = c, or c - 1 for the last chunk
        logits = logits[:, :targets.shape[1]]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                reduction="sum")
        total += float(nll)
        count += targets.numel()
    return total, count
