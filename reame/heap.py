"""The C heap of a long-running server: large blocks go back to the system when they are freed.

glibc gives a block of at least its mmap threshold a mapping of its own, unmapped when the block is freed;
but by default the threshold moves: each such block freed raises it to that block's size (up to 32 MiB), and
from then on blocks of that size come from the heap, where freed ones stay resident and fragment. A server
makes and drops KV snapshots of megabytes all day (the prefix cache's RAM tier, sessions, answers), so its
resident memory crept up beyond what its caches hold: `bench/soak.py` for 150 s grew 70 MiB beyond the RAM
tier's snapshots, 34 MiB with the threshold fixed at 1 MiB. Setting it also stops it moving.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def return_large_blocks() -> bool:
    """Fix the C heap's mmap threshold at MMAP_THRESHOLD_BYTES; False where the C library has no such
    setting (it then manages its heap its own way)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
