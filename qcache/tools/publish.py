"""Publish a calibration file like a model: a folder laid out like a hub repo (the file and a model card) and its
upload through huggingface_hub.

    repo layout (what `save_folder` writes and `push_to_hub` uploads)
    <repo>/qcache-calibration.safetensors   the calibration file (qcache.calibfile)
    <repo>/README.md                        model card: the model, the settings, the data and its sha256,
                                            measured quality when given, how to load it

Example:
    >>> save_folder("smollm2.qcache.safetensors", "out/smollm2-qcache-4bit")   # doctest: +SKIP
    >>> push_to_hub("out/smollm2-qcache-4bit", "org/smollm2-qcache-4bit")      # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from ..hub import CALIBRATION_FILENAME, CARD_FILENAME, is_offline, looks_like_repo_id
from .models import file_sha256

__all__ = ["model_card", "save_folder", "push_to_hub"]

logger = logging.getLogger(__name__)


def _base_model(name: str | None) -> str | None:
    """The hub id of the model a calibration was made for, when its name says it (short names know theirs)."""
    from .models import MODELS

    if not name:
        return None
    if name in MODELS:
        return MODELS[name].origin.split(",")[0].strip()
    return name if looks_like_repo_id(name) and not Path(name).exists() else None


def _demote_headings(markdown: str) -> str:
    """Every '#' heading one level down, so a report nests under the card's own section."""
    return "\n".join("#" + line if line.startswith("#") else line for line in markdown.strip().splitlines())


def model_card(data, file_sha256: str, repo_id: str | None = None, quality: str | None = None) -> str:
    """README.md text (YAML metadata + markdown) for a calibration file.

    Args:
        data: the `CalibrationData` (as `load_calibration` returns it).
        file_sha256: sha256 of the calibration file.
        repo_id: where it will live, for the usage snippet (default: a local folder path in the snippet).
        quality: markdown with measured quality (e.g. a `python -m eval.compare` table), put under its own heading.
    """
    from huggingface_hub import ModelCard, ModelCardData

    s, m, o = data.settings, data.model, data.options
    name = s.get("model") or m.get("model_type")
    base = _base_model(s.get("model"))
    card_data = ModelCardData(library_name="qcache", tags=["qcache", "kv-cache", "quantization"],
                              **({"base_model": base} if base else {}))
    types = m.get("layer_types") or ["full_attention"] * m["num_hidden_layers"]
    type_counts = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
    load_from = repo_id or "path/to/this/folder"
    lines = [
        f"# qcache calibration for {name}", "",
        f"Codebooks and key ranges for qcache's quantized KV cache "
        f"(`QuantCache`), fitted on real text for **{name}** at {o.get('k_bits')}-bit keys and "
        f"{o.get('v_bits')}-bit values.", "",
        "```python", "from qcache import QuantCache", "",
        f'cache = QuantCache.from_calibration("{load_from}")   # options, codebooks and ranges from the file',
        "out = model.generate(**inputs, past_key_values=cache)", "```", "",
        "## Model", "",
        "| field | value |", "|---|---|",
        f"| name given to the calibration | `{name}` |",
        *([f"| base model | `{base}` |"] if base else []),
        f"| model_type | `{m['model_type']}` |",
        f"| layers | {m['num_hidden_layers']} ({type_counts}) |",
        f"| KV heads x head_dim | {m['num_key_value_heads']} x {m['head_dim']} |",
        f"| RoPE | `{json.dumps(m.get('rope_parameters'), sort_keys=True)}` |", "",
        "A file made for another model (any field above differs) is refused when the cache binds to it.", "",
        "## Settings", "",
        "| setting | value |", "|---|---|",
        f"| bits (keys / values) | {o.get('k_bits')} / {o.get('v_bits')} |",
        f"| method | `{s.get('method', 'n/a')}` |",
        f"| calibrated layers | {sorted(data.layers)} |",
        f"| seed | {s.get('seed', 'n/a')} |",
        f"| model dtype | {s.get('dtype', 'n/a')} |",
        f"| qcache version | {data.qcache_version} |", "",
        "QuantCacheConfig options stored with the file (`from_calibration` uses them; keyword arguments override):",
        "", "```json", json.dumps(o, indent=2, sort_keys=True), "```", "",
        "## Data", "",
        "| field | value |", "|---|---|",
        f"| source | {s.get('data_source', 'n/a')} |",
        f"| sha256 | `{s.get('data_sha256', 'n/a')}` |",
        f"| sequences x tokens | {s.get('samples', 'n/a')} x {s.get('seq_len', 'n/a')} "
        f"({s.get('tokens', 'n/a')} tokens) |", "",
        "## Measured quality", "",
        _demote_headings(quality) if quality else "Not measured for this card (see `python -m eval.compare`).", "",
        "## File", "",
        f"`{CALIBRATION_FILENAME}`, sha256 `{file_sha256}`; safetensors with string metadata (model fingerprint, "
        "options, settings), validated on load: corrupt files, NaN/inf values, wrong shapes or dtypes, codebooks "
        "for other bits and files made for another model raise.",
        *(["", "It also holds the K (after RoPE) / V ranges of every layer and KV head, from which "
           "`python -m qcache.tools.export vllm` writes fp8 KV-cache scales."] if data.kv_ranges is not None else []),
    ]
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n").content


def save_folder(calibration: str | os.PathLike, out_dir: str | os.PathLike, quality: str | None = None,
                repo_id: str | None = None) -> Path:
    """Write a folder laid out like a hub repo: the calibration file (validated first) and its model card.

    Args:
        calibration: anything `load_calibration` takes.
        out_dir: the folder (created; files of the same names are replaced).
        quality: markdown with measured quality for the card.
        repo_id: the repo it is meant for (named in the card's usage snippet).
    """
    from ..calibfile import load_calibration

    data = load_calibration(calibration)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / CALIBRATION_FILENAME
    if Path(data.path).resolve() != target.resolve():
        shutil.copyfile(data.path, target)
    (out / CARD_FILENAME).write_text(model_card(data, file_sha256(target), repo_id, quality))
    logger.info("wrote %s and %s", target, out / CARD_FILENAME)
    return out


def push_to_hub(folder: str | os.PathLike, repo_id: str, private: bool = False, token: str | None = None,
                commit_message: str = "qcache calibration") -> str:
    """Upload a folder written by `save_folder` to the hub repo `repo_id` (created if missing); returns the
    commit URL. Refuses when offline, or when the folder lacks the calibration file or the card."""
    folder = Path(folder)
    if not looks_like_repo_id(repo_id):
        raise ValueError(f"repo_id={repo_id!r} is not a hub repo id; allowed: 'org/name'")
    missing = [n for n in (CALIBRATION_FILENAME, CARD_FILENAME) if not (folder / n).is_file()]
    if missing:
        raise ValueError(f"{folder} lacks {missing}; write it with qcache.hub.save_folder first")
    if is_offline():
        raise ValueError(f"pushing to {repo_id!r} needs the network, but HF_HUB_OFFLINE=1; unset it to push "
                         f"(the folder {folder} is ready)")
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                             allow_patterns=[CALIBRATION_FILENAME, CARD_FILENAME])
    logger.info("pushed %s to %s", folder, repo_id)
    return str(getattr(info, "commit_url", info))
