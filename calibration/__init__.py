"""Calibration logic: collect statistics on real text, fit codebooks and static key ranges (the command: calibration/cli.py, run as python -m qcache.calibrate)."""

from .collect import collect_statistics
from .fit import fit_codebook, fit_static_key_range, key_samples, value_samples, weighted_lloyd
from .run import calibrate

__all__ = ["calibrate", "collect_statistics", "fit_codebook", "fit_static_key_range", "key_samples",
           "value_samples", "weighted_lloyd"]
