"""`python -m qcache.size`: the user's entry point; the sizing table is qcache/tools/size.py."""

import sys

from .tools.size import main

if __name__ == "__main__":
    sys.exit(main())
