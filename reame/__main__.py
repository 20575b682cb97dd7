"""Entry point for `python -m reame` and for dist/reame.pyz."""

import sys
import time

began = time.perf_counter()  # the startup line (cli.Startup) counts Reame's imports from here

from reame import native  # noqa: E402
from reame.cli import main  # noqa: E402

if __name__ == "__main__":
    native.activate_bundle()  # inside a .pyz: native parts extracted once, zstandard importable
    sys.exit(main(began=began))
