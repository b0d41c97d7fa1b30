"""The qcache release (recorded in calibration files and results)."""

__version__ = "0.1.0"
