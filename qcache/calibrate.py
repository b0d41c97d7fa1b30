"""`python -m qcache.calibrate`: the user's entry point; the command is calibration/cli.py."""

import sys

from calibration.cli import main

if __name__ == "__main__":
    sys.exit(main())
