"""Calibration files shared like models: where `calibration=` finds its file (a file, a folder laid out like a hub
repo, or a hub repo id). Writing and uploading such folders is `qcache.tools.publish`.

    repo layout
    <repo>/qcache-calibration.safetensors   the calibration file (qcache.calibfile)
    <repo>/README.md                        model card (qcache.tools.publish.model_card)

`resolve_calibration` turns what a user passes as `calibration=` into a local file: a file, such a folder, or a
hub repo id "org/name" read through `huggingface_hub` (the local Hugging Face cache first; no download when
`HF_HUB_OFFLINE=1`, read when called, not when huggingface_hub was imported).

Example:
    >>> from qcache import QuantCache
    >>> cache = QuantCache.from_calibration("org/smollm2-qcache-4bit")        # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["CALIBRATION_FILENAME", "CARD_FILENAME", "is_offline", "hub_cache_dir", "looks_like_repo_id",
           "resolve_calibration"]

logger = logging.getLogger(__name__)

CALIBRATION_FILENAME = "qcache-calibration.safetensors"
CARD_FILENAME = "README.md"
_TRUE = ("1", "on", "yes", "true")
_INSTALL = "pip install huggingface_hub (it comes with transformers)"


def is_offline() -> bool:
    """Whether hub downloads are off: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, or as huggingface_hub
    read it at import."""
    if any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> str | None:
    """The Hugging Face cache as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub), else None
    (huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def looks_like_repo_id(text: str) -> bool:
    """'org/name' that huggingface_hub accepts as a repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _from_folder(folder: Path, filename: str) -> Path:
    candidate = folder / filename
    if candidate.is_file():
        return candidate
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    raise ValueError(f"calibration folder {str(folder)!r} has no {filename!r}; its .safetensors files: {found}")


def resolve_calibration(source: str | os.PathLike, filename: str = CALIBRATION_FILENAME,
                        revision: str | None = None) -> Path:
    """A local path to the calibration file `source` names.

    Args:
        source: a file; a folder laid out like a hub repo (holding `filename`); or a hub repo id "org/name",
            whose `filename` is taken from the local Hugging Face cache, or downloaded unless HF_HUB_OFFLINE=1.
            An existing local path always wins over a repo id of the same spelling.
        filename: the file inside a folder or repo.
        revision: branch, tag or commit of a repo id (default: main).

    Raises ValueError when `source` is none of these, when the repo or the file is not found, and when
    offline with the file not in the cache (the message says how to get it).
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        return _from_folder(path, filename)
    text = os.fspath(source)
    if not looks_like_repo_id(text):
        raise ValueError(f"calibration {text!r} does not exist; allowed: a .safetensors file, a folder holding "
                         f"{filename!r}, or a hub repo id 'org/name'")
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as err:  # pragma: no cover - transformers depends on it
        raise ImportError(f"reading calibration {text!r} from the hub needs huggingface_hub: {_INSTALL}") from err
    offline, cache = is_offline(), hub_cache_dir()
    try:
        return Path(hf_hub_download(text, filename, revision=revision, cache_dir=cache, local_files_only=offline))
    except LocalEntryNotFoundError as err:
        if offline:
            raise ValueError(
                f"calibration {text!r} ({filename}, revision {revision or 'main'}) is not in the local Hugging Face "
                f"cache ({cache or 'the default cache'}) and HF_HUB_OFFLINE=1 forbids downloading it; download it "
                f"once online (`hf download {text} {filename}`) or unset HF_HUB_OFFLINE") from err
        raise ValueError(f"calibration {text!r}: could not reach the hub and the file is not cached: {err}") from err
    except EntryNotFoundError as err:
        raise ValueError(f"hub repo {text!r} has no {filename!r} (revision {revision or 'main'}); "
                         f"pass filename= for another file") from err
    except HfHubHTTPError as err:  # repository or revision not found, no access
        raise ValueError(f"calibration {text!r}: {type(err).__name__}: {err}") from err


# ---------------------------------------------------------------------------------------------------------
# Model card and repo folder
# ---------------------------------------------------------------------------------------------------------
