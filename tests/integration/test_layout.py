"""Every bound struct has the size and field offsets the pinned llama.h gives it.

A small C program compiled against the header with the system compiler prints
sizeof/offsetof; any drift between header and binding fails here, loudly.
"""

import ctypes
import shutil
import subprocess

import pytest

from reame.ctypes_llama import api
from reame.ctypes_llama.types import BOUND_STRUCTS

# ctypes names of anonymous members -> a C member that sits at the same offset.
ANONYMOUS_MEMBER = {("llama_model_kv_override", "value"): "val_i64"}


def c_layout_program() -> tuple[str, list[tuple[str, str, int]]]:
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "llama.h"', "int main(void) {"]
    expected = []
    for struct in BOUND_STRUCTS:
        name = struct.__name__
        lines.append(f'printf("%zu\\n", sizeof(struct {name}));')
        expected.append((name, "sizeof", ctypes.sizeof(struct)))
        for field_name, *_ in struct._fields_:
            c_name = ANONYMOUS_MEMBER.get((name, field_name), field_name)
            lines.append(f'printf("%zu\\n", offsetof(struct {name}, {c_name}));')
            expected.append((name, field_name, getattr(struct, field_name).offset))
    lines += ["return 0;", "}"]
    return "\n".join(lines), expected


def test_struct_sizes_and_offsets_match_the_pinned_header(native_libraries, tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.fail("no C compiler found: the layout test needs cc, gcc or clang")
    assert native_libraries.include_dir is not None, "the build cache holds no headers"
    source, expected = c_layout_program()
    (tmp_path / "layout.c").write_text(source)
    subprocess.run([compiler, "-std=c11", "-I", str(native_libraries.include_dir), "-o",
                    str(tmp_path / "layout"), str(tmp_path / "layout.c")], check=True)
    printed = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True,
                             text=True).stdout.split()
    actual = [int(value) for value in printed]
    mismatches = [f"{struct}.{field}: ctypes {want}, C {got}"
                  for (struct, field, want), got in zip(expected, actual) if want != got]
    assert len(actual) == len(expected)
    assert not mismatches, "binding drifted from llama.h:\n" + "\n".join(mismatches)


def test_every_prototype_binds_to_a_library_symbol(native_libraries):
    api.load()
    for name in api.declared_names():
        assert callable(getattr(api, name)), name
