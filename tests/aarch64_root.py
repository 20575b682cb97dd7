"""A minimal Debian arm64 root with its python3, to run the .pyz under qemu-aarch64-static.

    python tests/aarch64_root.py [ROOT]     (default ROOT: ~/.cache/reame/aarch64-root)

`debootstrap --foreign` downloads and unpacks the packages (nothing arm64 is run, so no binfmt
registration is needed), from the Debian mirror and suite apt already uses; the packages python3
needs, which the foreign stage only downloads, are unpacked too. Made once: an existing root is kept.
No libgomp or GCC in it, on purpose: the .pyz must bring what its libraries need.
Needs root (debootstrap) and Debian's debootstrap and qemu-user-static.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reame.native import cache_root  # noqa: E402

READY = ".reame-ready"


def default_root() -> Path:
    return Path(os.environ.get("REAME_AARCH64_ROOT") or cache_root() / "aarch64-root")


def apt_mirror() -> tuple[str, str]:
    """(repository URI, suite) of the Debian release this machine runs, as apt is configured."""
    release = Path("/etc/os-release").read_text().splitlines()
    codename = next((line.split("=", 1)[1].strip().strip('"') for line in release
                     if line.startswith("VERSION_CODENAME=")), "")
    targets = subprocess.run(["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE)"], capture_output=True,
                             text=True, check=True).stdout.split("\n")
    for line in targets:
        uri, _, release = line.partition(" ")
        if release.strip() == codename:
            return uri, codename
    raise SystemExit(f"no apt source for {codename!r} in apt-get indextargets")


def build(root: Path) -> Path:
    if (root / READY).exists():
        return root
    mirror, suite = apt_mirror()
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".aarch64-root-", dir=root.parent))
    try:
        subprocess.run(["debootstrap", "--foreign", "--arch=arm64", "--variant=minbase", "--include=python3",
                        suite, str(staging), mirror], check=True, stdout=subprocess.DEVNULL)
        archives = staging / "var" / "cache" / "apt" / "archives"
        for package in sorted(archives.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(package), str(staging)], check=True)
            package.unlink()
        (staging / READY).write_text(f"{suite} {mirror}\n")
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else default_root()))
