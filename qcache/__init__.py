"""qcache: a quantized KV cache for PyTorch and Hugging Face Transformers."""

from .attention import register_fp32_attention, use_fp32_attention
from .cache import CacheMemory, QuantCache, QuantLayer
from .config import SUPPORTED_BITS, QuantCacheConfig
from .quant import dequantize, dequantize_grouped, pack, quantize, quantize_grouped, unpack

from ._version import __version__

# `from_pretrained(..., attn_implementation="qcache_fp32")` works after `import qcache`: the name is registered in
# transformers' attention (and mask) interfaces, the documented way to get fp32 accumulation and the fused decode
register_fp32_attention()

__all__ = [
    "QuantCache",
    "use_fp32_attention",
    "register_fp32_attention",
    "QuantLayer",
    "QuantCacheConfig",
    "CacheMemory",
    "SUPPORTED_BITS",
    "pack",
    "unpack",
    "quantize",
    "dequantize",
    "quantize_grouped",
    "dequantize_grouped",
    "__version__",
]
