"""What qcache needs from Transformers, checked where a mismatch would otherwise measure the wrong cache.

Two things the cache relies on arrived in Transformers 5.24.0 (older 5.x releases were tried, see below):

* models and `generate` take the cache as `cache=` (and still as the deprecated `past_key_values=`). Before
  5.24 a model's `forward(..., cache=QuantCache(...))` swallows the unknown keyword in `**kwargs`, builds its
  own `DynamicCache` and returns full-precision results without an error.
* attention passes its kwargs (with `position_ids`) to `Cache.update`, which qcache needs to undo and redo RoPE
  at each token's own position. Before 5.24, `update` gets no positions.

Releases tried with a tiny Llama, `model(x, cache=...)`, `model(x, past_key_values=...)` and
`generate(..., past_key_values=QuantCache(bits=4))`: 5.0.0 and 5.12.1 (the cache layer API differs as well:
`get_max_cache_shape`), 5.18.0, 5.21.0, 5.22.2, 5.23.0 (`cache=` swallowed, no position_ids), 5.24.0 (works).

`check_transformers()` refuses a release outside the supported range with the pip command that fixes it, and
warns once on a minor release newer than the newest one CI tests (`TESTED_MINORS`): the binding is checked by
behaviour where it is used (the rotary function is called, `position_ids` must arrive in `Cache.update`, the
attention module must be found), and each such check's error names the installed version through `binding_context()`.
`require_cache_written()` catches the other way to measure the wrong cache: a forward that was handed a cache
and did not write to it.
"""

from __future__ import annotations

import functools
import logging

__all__ = [
    "TRANSFORMERS_FLOOR",
    "TRANSFORMERS_CEILING",
    "TRANSFORMERS_FIX",
    "TESTED_MINORS",
    "TransformersVersionError",
    "CacheNotWrittenError",
    "transformers_supported",
    "check_transformers",
    "binding_context",
    "binding_report",
    "require_cache_written",
]

TRANSFORMERS_FLOOR = (5, 24)  # first release with `cache=` and position_ids in Cache.update kwargs
TRANSFORMERS_CEILING = (6,)  # next major release: not tried
TRANSFORMERS_FIX = "pip install 'transformers>=5.24,<6'"
# the minor releases `.ci/run` tests: the floor and the newest pip resolved when it was last raised
TESTED_MINORS = ((5, 24), (5, 25))

logger = logging.getLogger(__name__)


class TransformersVersionError(ImportError):
    """The installed Transformers cannot hand qcache's cache what it needs."""


class CacheNotWrittenError(RuntimeError):
    """A forward that was given a cache did not store its tokens in it (the model used a cache of its own)."""


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion as err:
        raise TransformersVersionError(
            f"transformers version {version!r} is not a version number; qcache needs "
            f">={'.'.join(map(str, TRANSFORMERS_FLOOR))},<{TRANSFORMERS_CEILING[0]}: {TRANSFORMERS_FIX}"
        ) from err


def transformers_supported(version: str) -> bool:
    """Whether a Transformers release `version` (e.g. "5.24.0", "5.24.0.dev0") is in the supported range.

    Example:
        >>> transformers_supported("5.24.0"), transformers_supported("5.23.0"), transformers_supported("6.0.0")
        (True, False, False)
    """
    release = _release(version)
    return TRANSFORMERS_FLOOR <= release < TRANSFORMERS_CEILING


@functools.cache
def _check_installed(version: str) -> str:
    if not transformers_supported(version):
        raise TransformersVersionError(
            f"qcache needs transformers>={'.'.join(map(str, TRANSFORMERS_FLOOR))},<{TRANSFORMERS_CEILING[0]} and "
            f"found {version}: older releases drop `cache=` silently (the model builds a full-precision "
            f"DynamicCache) and do not pass position_ids to Cache.update; a newer major release is untested. "
            f"Fix: {TRANSFORMERS_FIX}"
        )
    if _release(version)[:2] > TESTED_MINORS[-1]:
        logger.warning("qcache was tested with transformers %s; found %s. What the cache relies on is checked where it "
                       "is used and raises naming this version; `python -m qcache.check` runs the check on tiny "
                       "models in seconds", _tested_text(), version)
    return version


def _tested_text() -> str:
    return " and ".join(".".join(map(str, m)) for m in TESTED_MINORS)


def _installed_version() -> str:
    import transformers

    return transformers.__version__


def binding_context() -> str:
    """"transformers X (tested: ...)": what an error about the binding to transformers says of the installed release."""
    return f"transformers {_installed_version()}, qcache tested with {_tested_text()}"


def binding_report() -> str:
    """One line naming the versions the binding depends on (`python -m qcache.check` prints it first)."""
    import importlib.metadata

    import torch

    from ._version import __version__

    try:
        kernels = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        kernels = "not installed"
    version = _installed_version()
    tested = "tested" if _release(version)[:2] in TESTED_MINORS else f"untested (qcache tested with {_tested_text()})"
    return (f"qcache {__version__}; transformers {version} ({tested}); kernels {kernels}; torch {torch.__version__}")


def check_transformers(version: str | None = None) -> str:
    """Raise `TransformersVersionError` (an ImportError naming the fix) unless Transformers `version` (default: the
    installed one) is supported; return the version checked."""
    return _check_installed(_installed_version() if version is None else version)


def require_cache_written(cache, length_before: int, added: int, where: str) -> int:
    """Raise `CacheNotWrittenError` unless `cache` grew from `length_before` by `added` tokens during a forward
    (`where` names it in the message); return the new length.

    A model that silently ignores the cache it was handed (a keyword it does not know, a wrapper that drops it)
    builds a `DynamicCache` of its own: its results are full precision whatever cache the caller meant to measure.
    """
    length = cache.get_seq_length()
    if length != length_before + added:
        raise CacheNotWrittenError(
            f"{where}: the {type(cache).__name__} given to the model holds {length} tokens after {added} more "
            f"went through the model (expected {length_before + added}): the model did not write to it, so the results "
            f"are not from that cache. Pass it as `cache=` to a model that takes it (transformers: "
            f"{TRANSFORMERS_FIX}) and do not wrap the model in code that drops the keyword"
        )
    return length
