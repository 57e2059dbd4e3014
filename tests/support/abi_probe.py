"""Compare ctypes declarations with a C header, through a small compiled probe.

The probe is a C program generated from the ctypes side: for every structure
it prints ``sizeof``, and for every field (nested structures walked) its
``offsetof`` and size; for every constant its value. It is compiled with gcc
against the real (or reference) header, so a field the header does not have
fails the build, and any difference in size, offset or value is reported.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

Layout = dict[str, tuple[int, int]]  # "Struct.field.sub" -> (offset, size); "Struct" -> (0, size)


def ctypes_layout(c_name: str, ctype: type) -> Layout:
    """The layout ctypes computes for ``ctype``, under the C type name ``c_name``."""
    out: Layout = {c_name: (0, ctypes.sizeof(ctype))}

    def walk(prefix: str, struct: type, base: int) -> None:
        for name, field_type, *_ in getattr(struct, "_fields_", ()):
            descriptor = getattr(struct, name)
            out[f"{prefix}.{name}"] = (base + descriptor.offset, descriptor.size)
            if issubclass(field_type, ctypes.Structure):
                walk(f"{prefix}.{name}", field_type, base + descriptor.offset)

    walk(c_name, ctype, 0)
    return out


def _probe_source(includes: Iterable[str], layouts: Mapping[str, Layout],
                  constants: Iterable[str]) -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>"]
    lines += [f"#include {inc}" for inc in includes]
    lines.append("int main(void) {")
    for c_name, layout in layouts.items():
        for path in layout:
            if path == c_name:
                lines.append(f'    printf("%s 0 %zu\\n", "{path}", sizeof({c_name}));')
                continue
            member = path[len(c_name) + 1:]
            lines.append(f'    printf("%s %zu %zu\\n", "{path}", offsetof({c_name}, {member}), '
                         f"sizeof((({c_name} *)0)->{member}));")
    for name in constants:
        lines.append(f'    printf("%s %lld\\n", "{name}", (long long)({name}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


def run_probe(out_dir: Path, includes: Iterable[str], include_dirs: Iterable[Path],
              layouts: Mapping[str, Layout], constants: Iterable[str],
              defines: Iterable[str] = ()) -> tuple[Layout, dict[str, int]]:
    """Compile and run the probe; return ``(layout as C sees it, constant values)``."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc/cc) to build the ABI probe")
    constants = list(constants)
    out_dir.mkdir(parents=True, exist_ok=True)
    source, exe = out_dir / "abi_probe.c", out_dir / "abi_probe"
    source.write_text(_probe_source(includes, layouts, constants))
    flags = ["-Wall", "-Werror", *(f"-I{d}" for d in include_dirs), *defines]
    proc = subprocess.run([compiler, *flags, "-o", str(exe), str(source)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"the ABI probe does not compile against the header (a ctypes "
                             f"field the header lacks?):\n{proc.stderr}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    layout: Layout = {}
    values: dict[str, int] = {}
    for line in run.stdout.splitlines():
        name, *numbers = line.split()
        if name in constants:
            values[name] = int(numbers[0])
        else:
            layout[name] = (int(numbers[0]), int(numbers[1]))
    return layout, values


def layout_mismatches(expected: Layout, actual: Layout, header: str) -> list[str]:
    """One line per entry whose (offset, size) differs: ctypes first, then the header."""
    return [f"{path}: ctypes offset {off} size {size}, {header} offset "
            f"{actual[path][0]} size {actual[path][1]}"
            for path, (off, size) in expected.items() if actual.get(path) != (off, size)]
