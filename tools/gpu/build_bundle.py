"""Build the offline bundle that runs vLLM 0.23.0 and this project on the GPU machine.

    python tools/gpu/build_bundle.py [--out build/gpu_bundle] [--flash-attn 3|2|all]
                                     [--part-mib 56] [--python312 PATH]

Steps (each output under ``--out``, which .gitignore keeps out of git):

1. download vLLM 0.23.0's GPU wheel (cached in ``download/``);
2. repack it without the kernels the run never loads (``bundle_repack.py``);
3. build this project's wheel with a Python 3.12 (its CPU copy extension is cp312) from
   a commit (``--ref``, default HEAD: not the working tree's uncommitted edits);
4. resolve with pip, for CPython 3.12 on manylinux x86_64, vLLM's requirements on
   needed distributions (metadata only, the machine's known versions as
   constraints), then download, at the resolved versions, the needed distributions
   the machine lacks or may hold at a version the set does not accept
   (``bundle_deps.py``);
5. check the set offline (``check_bundle.py``);
6. add the tests and benchmarks (``src.tar.gz``) and split ``payload/`` into parts of
   at most ``--part-mib`` MiB with a manifest of sha256s (``parts/``).

``report.json`` says what was shipped and why, sizes and the check's findings.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bundle_deps  # noqa: E402
import bundle_parts  # noqa: E402
import bundle_repack  # noqa: E402
import check_bundle  # noqa: E402

ROOT = HERE.parent.parent
VLLM_REQ = "vllm==0.23.0"
#: manylinux tags the machine's glibc (2.39) accepts; pip matches each exactly.
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)]
             + ["manylinux2014_x86_64", "manylinux1_x86_64"])
#: Machine packages whose known version the resolution may leave: numpy, since
#: mistral_common (every release vLLM 0.23 accepts) caps it below 2.4 on Python 3.12
#: and the machine has 2.5.2; the bundle then carries a numpy the whole set accepts.
UNPINNED = {"numpy"}
SOURCES = ("tests", "benchmarks", "tools/gpu", "pytest.ini")


def pip_download(requirements: list[str], dest: Path) -> None:
    """``pip download`` wheels for CPython 3.12, manylinux x86_64, no dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           *target_args(), "-d", str(dest), *requirements]
    subprocess.run(cmd, check=True)


def target_args() -> list[str]:
    args = ["--python-version", "3.12", "--implementation", "cp",
            "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def fetch_vllm(out: Path, flash_attn: str, wheels: Path) -> Path:
    cache = out / "download"
    cache.mkdir(parents=True, exist_ok=True)
    if not list(cache.glob("vllm-0.23.0-*.whl")):
        pip_download([VLLM_REQ], cache)
    src = sorted(cache.glob("vllm-0.23.0-*.whl"))[-1]
    dest = wheels / src.name
    if flash_attn == "all":
        shutil.copy2(src, dest)
    else:
        dropped = bundle_repack.repack(src, dest, bundle_repack.DROP_SETS[flash_attn])
        print(f"repacked {src.name}: dropped {len(dropped)} files, "
              f"{src.stat().st_size >> 20} -> {dest.stat().st_size >> 20} MiB")
    return dest


def export_tree(ref: str, dest: Path) -> str:
    """The files of commit ``ref`` under ``dest`` (what the bundle is built from, not
    the working tree's uncommitted edits); returns the commit's sha."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "SOURCE_COMMIT").write_text(sha + "\n")
    return sha


def build_own_wheel(python312: str, tree: Path, wheels: Path) -> Path:
    """This project's wheel for CPython 3.12 (its optional C extension built for it)."""
    tmp = wheels.parent / "own_wheel"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([python312, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp),
                    str(tree)], check=True)
    (built,) = tmp.glob("kvoffload_hal-*.whl")
    return Path(shutil.copy2(built, wheels / built.name))


def pip_resolve(roots: list[bundle_deps.Dist], needed: list[str], machine: dict,
                workdir: Path) -> list[bundle_deps.Dist]:
    """pip's resolution, for the target, of the requirements of ``roots`` (vLLM's
    wheel and ours) on needed distributions, with the machine's known versions as
    constraints; metadata only (``--dry-run --report``). vLLM's kernel packages the
    run never imports (flashinfer, tilelang, ...) stay out of it: their own pins
    need not agree with the machine's packages."""
    constraints = workdir / "machine_constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in machine.items()
                                   if v and n not in UNPINNED))
    wanted = set(needed)
    # Markers already evaluated for the target: pip would evaluate them for the
    # Python it runs on, not for --python-version.
    requirements = sorted({bundle_deps.without_marker(r) for d in roots for r in d.requires
                           if bundle_deps.canonicalize_name(r.name) in wanted})
    report = workdir / "resolution.json"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
           "--report", str(report), "--only-binary=:all:", "--target", str(workdir / "t"),
           *target_args(), "-c", str(constraints), *requirements]
    subprocess.run(cmd, check=True)
    return bundle_deps.report_dists(json.loads(report.read_text()))


def resolve_dependencies(wheels: Path, needed: list[str], machine: dict) -> list[str]:
    """Download the needed distributions the machine may not serve, at the versions of
    pip's resolution; returns their names. Only the requirements of what travels
    (vLLM, ours, and what they pull in) decide: a machine package's own requirements
    hold in the machine's image."""
    roots = [bundle_deps.wheel_dist(p) for p in sorted(wheels.glob("*.whl"))]
    resolved = {d.name: d for d in pip_resolve(roots, needed, machine, wheels.parent)}
    ship: list[str] = []
    while True:
        sources = roots + [resolved[n] for n in ship if n in resolved]
        specs = bundle_deps.specifiers_on(sources, set(needed))
        grown = [n for n in bundle_deps.to_ship(needed, machine, specs) if n != "vllm"]
        if grown == ship:
            break
        ship = grown
    missing = [n for n in ship if n not in resolved]
    if missing:
        raise RuntimeError(f"needed but not in pip's resolution: {', '.join(missing)}")
    print(f"downloading {len(ship)}: {' '.join(ship)}")
    pip_download([f"{n}=={resolved[n].version}" for n in ship], wheels)
    return ship


def pack_sources(tree: Path, dest: Path) -> Path:
    path = dest / "src.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in (*SOURCES, "SOURCE_COMMIT"):
            tar.add(tree / name, arcname=name)
    return path


def find_python312() -> str:
    for candidate in ("python3.12", str(Path.home() / ".pyenv/versions/3.12.1/bin/python")):
        found = shutil.which(candidate)
        if found and subprocess.run([found, "-V"], capture_output=True).returncode == 0:
            return found
    raise SystemExit("no Python 3.12 found: pass --python312 PATH")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_bundle")
    parser.add_argument("--flash-attn", choices=("3", "2", "all"), default="3",
                        help="the FlashAttention build kept in vLLM's wheel (H100/H200: 3)")
    parser.add_argument("--part-mib", type=int, default=56,
                        help="largest part, MiB (a transfer carries 64 MiB with the tree)")
    parser.add_argument("--python312", default=None, help="a CPython 3.12 to build our wheel")
    parser.add_argument("--ref", default="HEAD",
                        help="the commit whose package, tests and benchmarks travel")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    payload = args.out / "payload"
    shutil.rmtree(payload, ignore_errors=True)
    payload.mkdir(parents=True)
    tree = args.out / "source"
    sha = export_tree(args.ref, tree)
    fetch_vllm(args.out, args.flash_attn, payload)
    build_own_wheel(args.python312 or find_python312(), tree, payload)
    needed, machine = bundle_deps.load_needed(), bundle_deps.load_machine()
    shipped = resolve_dependencies(payload, needed, machine)
    report = check_bundle.check(payload, needed, machine)
    pack_sources(tree, payload)
    manifest = bundle_parts.split(payload, args.out / "parts", args.part_mib << 20)
    report.update(source_commit=sha, shipped=shipped, flash_attn=args.flash_attn,
                  payload_bytes=sum(f["size"] for f in manifest["files"]),
                  parts=[(p["name"], p["size"]) for p in manifest["parts"]])
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(check_bundle.summary(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
