"""What every lm-eval run of this project needs: offline settings, our task folder, short model names resolved.

Example:
    >>> offline_environment()                                      # doctest: +SKIP
    >>> resolve_names({"pretrained": "smollm2-135m", "bits": 4})   # doctest: +SKIP
    {'pretrained': '/root/.cache/qcache/models/smollm2-135m', 'bits': 4}
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["TASKS_DIR", "ruler_dir", "RETRIEVAL_TASKS", "offline_environment", "resolve_names", "task_manager"]

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # qcache_ppl, qcache_passkey
RETRIEVAL_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "qcache_passkey")
_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
_NAME_KEYS = ("pretrained", "tokenizer")


def ruler_dir() -> Path:
    """lm-eval's RULER task folder."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent / "ruler"


def offline_environment() -> None:
    """No hub downloads at run time (unless the caller set these variables), and no nltk download either.

    lm-eval's RULER module downloads nltk's `punkt_tab` when it is imported. The tasks we run (niah_single_1,
    niah_multikey_2/3: "repeat" and "needle" haystacks) never use it, so when it is missing and we are offline
    the download is replaced by a warning; tasks that do need it (essay haystacks) then fail naming punkt_tab.
    """
    for key, value in _OFFLINE.items():
        os.environ.setdefault(key, value)
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        return
    try:
        import nltk
    except ImportError:
        return
    try:
        nltk.data.find("tokenizers/punkt_tab")
    except LookupError:
        def no_download(info_or_id=None, *args, **kwargs):
            logger.warning("offline: not downloading nltk resource %r (RULER's essay haystacks need it)", info_or_id)
            return False

        nltk.download = no_download


def resolve_names(args: dict | None) -> dict:
    """`args` with short model names under `pretrained` / `tokenizer` replaced by their local directories (RULER
    loads the tokenizer from that string with AutoTokenizer, which knows nothing of short names)."""
    from qcache.tools.models import resolve_model

    args = dict(args or {})
    for key in _NAME_KEYS:
        if isinstance(args.get(key), str):
            args[key] = resolve_model(args[key])
    return args


def task_manager(metadata: dict | None = None, include_defaults: bool = False):
    """A TaskManager that knows our tasks and RULER's (all of lm-eval's with `include_defaults`, slower)."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] if include_defaults else [str(TASKS_DIR), str(ruler_dir())]
    return TaskManager(include_path=paths, include_defaults=include_defaults, metadata=metadata or {})
