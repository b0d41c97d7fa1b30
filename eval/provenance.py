"""Where a result came from: the git checkout it ran on and how loaded the machine was (times are noise when it was).

Example:
    >>> sorted(git_state() or {"commit": 0, "dirty": 0})
    ['commit', 'dirty']
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["git_state", "load_average"]


def git_state() -> dict | None:
    """The checkout the run used (commit, and whether tracked files differed from it), when it is a git one."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None
