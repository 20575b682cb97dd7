"""Entry point for `python -m reame` and for dist/reame.pyz."""

import sys

from reame import native
from reame.cli import main

if __name__ == "__main__":
    native.activate_bundle()  # inside a .pyz: native parts extracted once, zstandard importable
    sys.exit(main())
