"""Shared checks of the compiled read and the fused decode (used by the tests of each codec option)."""

import torch

from qcache import QuantCache
from qcache.attention import fp32_sdpa_attention_forward
from qcache.handover import HeldStates


def feed(cache, steps, seed=0):
    """A 70-token prefill, then `steps` single tokens, of random bf16 states [1, 2, n, 32] into layer 0."""
    g = torch.Generator().manual_seed(seed)
    outs, pos = [], 0
    for n in [70] + [1] * steps:
        k, v = (torch.randn(1, 2, n, 32, generator=g).to(torch.bfloat16) for _ in range(2))
        outs.append(cache.update(k, v, 0, kwargs={"position_ids": torch.arange(pos, pos + n)[None]}))
        pos += n
    return outs


def compiled_matches_eager(config, steps=3, **options):
    """The compiled read returns what the eager read returns (fp32 in both, within bf16 rounding); returns the
    compiled cache."""
    eager = QuantCache(config, kernel="eager", **options)
    fused = QuantCache(config, kernel="compiled", **options)
    for (ke, ve), (kf, vf) in zip(feed(eager, steps), feed(fused, steps)):
        torch.testing.assert_close(kf, ke, rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(vf, ve, rtol=2**-7, atol=1e-3)
    assert fused.layers[0].kernel == "compiled" and fused.layers[0].quantized_length > 0
    return fused


def fused_decode_matches_read(layer, position):
    """One decode step at `position` attended straight from the codes equals qcache_fp32 attention over `read()`."""
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, 1, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    keys, values = layer.update(k, v, kwargs={"position_ids": torch.tensor([[position]])})
    assert isinstance(keys, HeldStates) and keys.step.layer is layer
    full_k, full_v = layer.read()
    query = torch.randn(1, 4, 1, 32, generator=g).to(torch.bfloat16)
    module = torch.nn.Module()
    out, _ = fp32_sdpa_attention_forward(module, query, keys, values, None, scaling=0.2)
    ref, _ = fp32_sdpa_attention_forward(module, query, full_k, full_v, None, scaling=0.2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2e-3)


def same_greedy_run(tokens, logits, ref_tokens, ref_logits, tol=0.05):
    """Greedy runs through two read paths that round differently (bf16 attention over the read, fp32 attention from
    the codes): the same tokens with logits within `tol` of the reference's std, or tokens that part only where the
    reference's own top two are within that (a near tie)."""
    same = int((tokens == ref_tokens).cumprod(0).sum())
    std = float(ref_logits.std())
    assert (logits[:same + 1] - ref_logits[:same + 1]).abs().max() <= tol * std
    if same < len(tokens):
        top2 = ref_logits[same].topk(2).values
        assert float(top2[0] - top2[1]) <= tol * std
