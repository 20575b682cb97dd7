"""Reame's patches to the pinned ggml, checked kernel by kernel on the built library (third_party/patches).

0002: on x86 with AVX2 a repacked Q4_K weight multiplies groups of four rows with a gemm that rounds after
every pair of sub-blocks, and a lone row with a gemv that rounds once per superblock. The patch's
`ggml_gemm_q4_K_8x8_q8_K_invariant` is the gemm in gemv's order; the reference path (row by row, the engine's
exact steps) uses it. Every row it computes must be bit-identical to the same row through gemv, on each of
the kernel's paths (16-row and 4-row groups, 16- and 8-column blocks); the stock gemm must differ, or these
inputs would prove nothing."""

import ctypes
import random
import struct

import pytest

from reame.ctypes_llama._lib import load_libraries
from reame.native import machine

Q4_K_X8_BYTES = 16 + 16 + 96 + 1024  # block_q4_Kx8: d[8], dmin[8] (fp16), scales[96], qs[1024]
Q8_K_BYTES = 4 + 256 + 32  # block_q8_K: d, qs[256], bsums[16]
Q8_K_X4_BYTES = 4 * 4 + 1024 + 128  # block_q8_Kx4: d[4], qs[1024], bsums[64]
QK_K = 256

pytestmark = pytest.mark.skipif(machine() != "x86_64", reason="the patched kernel is x86's")


@pytest.fixture(scope="module")
def ggml_cpu(native_libraries):
    load_libraries()  # ggml-base first, globally: ggml-cpu links to it by soname
    library = ctypes.CDLL(str(native_libraries.path_of("ggml-cpu")))
    kernel = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
              ctypes.c_int]
    for name in ("ggml_gemm_q4_K_8x8_q8_K", "ggml_gemm_q4_K_8x8_q8_K_invariant", "ggml_gemv_q4_K_8x8_q8_K"):
        getattr(library, name).argtypes = kernel
        getattr(library, name).restype = None
    for name in ("ggml_quantize_mat_q8_K_4x8", "quantize_row_q8_K"):
        getattr(library, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        getattr(library, name).restype = None
    if not library.ggml_cpu_has_avx2():
        pytest.skip("this CPU has no AVX2: Q4_K weights are not repacked 8x8")
    return library


def random_q4_k_weights(rng: random.Random, n: int, columns: int) -> ctypes.Array:
    """Columns/8 x n/256 interleaved Q4_K blocks: random nibbles and scales, fp16 scales of a sane size."""
    blocks = bytearray(rng.randbytes(Q4_K_X8_BYTES * (columns // 8) * (n // QK_K)))
    for block in range(len(blocks) // Q4_K_X8_BYTES):
        halves = [0x2000 + rng.randrange(0x400) for _ in range(16)]
        blocks[block * Q4_K_X8_BYTES:block * Q4_K_X8_BYTES + 32] = struct.pack("<16H", *halves)
    return (ctypes.c_char * len(blocks)).from_buffer(blocks)


def products(ggml_cpu, rows: int, columns: int, n: int, seed: int) -> tuple[bytes, bytes, bytes]:
    """The same rows x weights product by the stock gemm, the invariant gemm and gemv row by row."""
    rng = random.Random(seed)
    weights = random_q4_k_weights(rng, n, columns)
    values = (ctypes.c_float * (rows * n))(*[rng.uniform(-1, 1) * (6 if rng.random() < 0.01 else 1)
                                             for _ in range(rows * n)])
    blocks = n // QK_K
    grouped = ctypes.create_string_buffer(Q8_K_X4_BYTES * blocks * rows // 4)
    for group in range(rows // 4):
        ggml_cpu.ggml_quantize_mat_q8_K_4x8(ctypes.byref(values, 4 * group * 4 * n),
                                           ctypes.byref(grouped, group * blocks * Q8_K_X4_BYTES), n)
    out_size = rows * columns * 4
    stock, invariant, alone = (ctypes.create_string_buffer(out_size) for _ in range(3))
    ggml_cpu.ggml_gemm_q4_K_8x8_q8_K(n, stock, columns, weights, grouped, rows, columns)
    ggml_cpu.ggml_gemm_q4_K_8x8_q8_K_invariant(n, invariant, columns, weights, grouped, rows, columns)
    row = ctypes.create_string_buffer(Q8_K_BYTES * blocks)
    for index in range(rows):
        ggml_cpu.quantize_row_q8_K(ctypes.byref(values, 4 * index * n), row, n)
        ggml_cpu.ggml_gemv_q4_K_8x8_q8_K(n, ctypes.byref(alone, index * columns * 4), columns, weights, row, 1,
                                         columns)
    return stock.raw, invariant.raw, alone.raw


@pytest.mark.parametrize("rows", [4, 8, 16, 20])
@pytest.mark.parametrize("columns", [8, 16, 24])
@pytest.mark.parametrize("n", [256, 1536])
def test_the_invariant_q4_k_gemm_computes_every_row_as_gemv_does(ggml_cpu, rows, columns, n):
    stock, invariant, alone = products(ggml_cpu, rows, columns, n, seed=rows * 1000 + columns * 10 + n)
    assert invariant == alone
    assert stock != alone


# 0005: a Q6_K weight is not repacked on x86; the reference path multiplied it column by column with
# ggml_vec_dot_q6_K_q8_K. `ggml_vec_dot_q6_K_q8_K_cols` takes up to 16 columns at once, each exactly as vec_dot.
Q6_K_BYTES = 128 + 64 + 16 + 2  # block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16)


@pytest.fixture(scope="module")
def q6_k_kernels(ggml_cpu):
    ggml_cpu.ggml_vec_dot_q6_K_q8_K.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ggml_cpu.ggml_vec_dot_q6_K_q8_K_cols.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                     ctypes.c_void_p, ctypes.c_int]
    for name in ("ggml_vec_dot_q6_K_q8_K", "ggml_vec_dot_q6_K_q8_K_cols"):
        getattr(ggml_cpu, name).restype = None
    ggml_cpu.ggml_cpu_init()  # the fp16 table the Q6_K kernels read their scales through
    return ggml_cpu


def random_q6_k_row(rng: random.Random, n: int) -> ctypes.Array:
    """n/256 Q6_K blocks: random codes and sub-block scales, an fp16 scale of a sane size."""
    blocks = bytearray(rng.randbytes(Q6_K_BYTES * (n // QK_K)))
    for block in range(n // QK_K):
        blocks[block * Q6_K_BYTES + Q6_K_BYTES - 2:(block + 1) * Q6_K_BYTES] = struct.pack("<H", 0x2000 +
                                                                                         rng.randrange(0x400))
    return (ctypes.c_char * len(blocks)).from_buffer(blocks)


@pytest.mark.parametrize("columns", [1, 2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("n", [256, 1536])
def test_q6_k_columns_together_are_each_vec_dots_own_result(q6_k_kernels, columns, n):
    rng = random.Random(columns * 100 + n)
    weights = random_q6_k_row(rng, n)
    rows = []
    for _ in range(columns):
        values = (ctypes.c_float * n)(*[rng.uniform(-1, 1) * (6 if rng.random() < 0.01 else 1) for _ in range(n)])
        row = ctypes.create_string_buffer(Q8_K_BYTES * (n // QK_K))
        q6_k_kernels.quantize_row_q8_K(values, row, n)
        rows.append(row)
    alone = (ctypes.c_float * columns)()
    for index, row in enumerate(rows):
        q6_k_kernels.ggml_vec_dot_q6_K_q8_K(n, ctypes.byref(alone, 4 * index), 0, weights, 0, row, 0, 1)
    together = (ctypes.c_float * columns)()
    pointers = (ctypes.c_void_p * columns)(*[ctypes.addressof(row) for row in rows])
    q6_k_kernels.ggml_vec_dot_q6_K_q8_K_cols(n, together, weights, pointers, columns)
    assert bytes(together) == bytes(alone)
    assert len(set(alone)) == columns  # distinct, non-trivial products: the comparison means something
