"""`python -m qcache.demo`: the user's entry point; the demo is qcache/tools/demo.py."""

import sys

from .tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
