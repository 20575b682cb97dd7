"""Entry point for `python -m reame` (and, later, the zipapp)."""

import sys

from reame.cli import main

if __name__ == "__main__":
    sys.exit(main())
