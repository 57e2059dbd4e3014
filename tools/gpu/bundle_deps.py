"""Which distributions the bundle carries, and whether the set is consistent.

The run needs the distributions in ``needed_dists.txt`` (what a plain engine run
imports). The GPU machine already has many (``machine_packages.txt``). A needed
distribution travels unless the machine's copy satisfies every requirement on it
from the needed set: a known version inside every specifier, or an unread version
where the specifiers are only lower bounds (the machine's image is newer than
vLLM 0.23's floors). :func:`check_set` then checks that every requirement between
needed distributions holds for the chosen versions, for CPython 3.12 on
manylinux x86_64.
"""

from __future__ import annotations

import email.parser
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
NEEDED_FILE = HERE / "needed_dists.txt"
MACHINE_FILE = HERE / "machine_packages.txt"

#: PEP 508 marker values of the GPU machine's Python.
TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_python_implementation": "CPython", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_release": "", "platform_version": "",
    "extra": "",
}
LOWER_BOUND_OPS = (">=", ">")


@dataclass
class Dist:
    """A distribution of the set: a wheel of the bundle or a machine package."""

    name: str  # canonical
    version: Version | None  # None: present, version unread
    requires: list[Requirement] = field(default_factory=list)
    wheel: Path | None = None


def read_list(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line]


def load_needed(path: Path = NEEDED_FILE) -> list[str]:
    return sorted({canonicalize_name(n) for n in read_list(path)})


def load_machine(path: Path = MACHINE_FILE) -> dict[str, Version | None]:
    """The machine's packages: canonical name -> version, or None where unread."""
    out: dict[str, Version | None] = {}
    for line in read_list(path):
        name, _, version = line.partition("==")
        out[canonicalize_name(name)] = Version(version) if version else None
    return out


def runtime_requires(lines: list[str]) -> list[Requirement]:
    """The requirements that apply on the target without extras."""
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def wheel_dist(path: Path) -> Dist:
    """Name, version and runtime requirements of a wheel, from its METADATA."""
    name, version, _, _ = parse_wheel_filename(Path(path).name)
    with zipfile.ZipFile(path) as zf:
        meta = [n for n in zf.namelist()
                if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if len(meta) != 1:
            raise ValueError(f"{Path(path).name}: expected one .dist-info/METADATA, "
                             f"found {len(meta)}")
        msg = email.parser.Parser().parsestr(zf.read(meta[0]).decode("utf-8"))
    requires = runtime_requires(msg.get_all("Requires-Dist") or [])
    return Dist(canonicalize_name(name), version, requires, Path(path))


def specifiers_on(dists: list[Dist], needed: set[str]) -> dict[str, SpecifierSet]:
    """Every needed distribution's combined specifier, from the requirements of ``dists``."""
    specs: dict[str, SpecifierSet] = {}
    for dist in dists:
        for req in dist.requires:
            target = canonicalize_name(req.name)
            if target in needed:
                specs[target] = specs.get(target, SpecifierSet()) & req.specifier
    return specs


def machine_serves(version: Version | None, spec: SpecifierSet | None) -> bool:
    """Whether the machine's copy (``version``, None if unread) satisfies ``spec``."""
    if spec is None or not str(spec):
        return True
    if version is None:
        return all(s.operator in LOWER_BOUND_OPS for s in spec)
    return spec.contains(version, prereleases=True)


def to_ship(needed: list[str], machine: dict, specs: dict[str, SpecifierSet]) -> list[str]:
    """The needed distributions the bundle must carry."""
    return [n for n in needed
            if n not in machine or not machine_serves(machine[n], specs.get(n))]


def requirement_args(names: list[str], specs: dict[str, SpecifierSet]) -> list[str]:
    """``pip download`` arguments: each name with its combined specifier."""
    return [f"{n}{specs.get(n, '')}" for n in names]


@dataclass
class SetReport:
    problems: list[str]
    left_out: list[str]  # requirements on distributions the run does not import
    trusted: list[str]  # machine packages used at an unread version (lower bounds only)

    @property
    def ok(self) -> bool:
        return not self.problems


def resolve_set(wheels: list[Dist], needed: list[str], machine: dict) -> dict[str, Dist]:
    """The set the run sees: bundle wheels first, then the machine's packages."""
    chosen = {d.name: d for d in wheels}
    for name in needed:
        if name not in chosen and name in machine:
            chosen[name] = Dist(name, machine[name])
    return chosen


def check_set(wheels: list[Dist], needed: list[str], machine: dict) -> SetReport:
    """Every needed distribution present once; every requirement among them holds."""
    problems, left_out, trusted = [], [], []
    names = [d.name for d in wheels]
    problems += [f"{n}: {names.count(n)} wheels in the bundle, expected one"
                 for n in sorted(set(names)) if names.count(n) > 1]
    chosen = resolve_set(wheels, needed, machine)
    problems += [f"{n}: needed, neither in the bundle nor on the machine"
                 for n in needed if n not in chosen]
    for dist in sorted(chosen.values(), key=lambda d: d.name):
        for req in dist.requires:
            target = canonicalize_name(req.name)
            have = chosen.get(target)
            if have is None:
                left_out.append(f"{dist.name} -> {req}")
            elif have.version is None:
                if not machine_serves(None, req.specifier):
                    problems.append(f"{dist.name} requires {req}; the machine's {target} "
                                    f"is of an unread version and is not in the bundle")
                elif str(req.specifier):
                    trusted.append(f"{dist.name} -> {req}")
            elif not req.specifier.contains(have.version, prereleases=True):
                where = "bundle" if have.wheel is not None else "machine"
                problems.append(f"{dist.name} requires {req}, the {where} has "
                                f"{target} {have.version}")
    return SetReport(problems, sorted(set(left_out)), sorted(set(trusted)))


def report_dists(report: dict) -> list[Dist]:
    """The distributions of a ``pip install --dry-run --report`` resolution."""
    out = []
    for item in report.get("install", []):
        meta = item["metadata"]
        out.append(Dist(canonicalize_name(meta["name"]), Version(meta["version"]),
                        runtime_requires(meta.get("requires_dist") or [])))
    return out


def without_marker(req: Requirement) -> str:
    """``req`` as a requirement string without its environment marker."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"
