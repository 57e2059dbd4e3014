"""What the ABC declares for every backend, and what the scheduler knows of a backend
without importing it (tests/unit/backends/test_copy_path_contract.py runs the values)."""

import json
import os
import subprocess
import sys

import pytest

from kvoffload_hal.hal import registry
from kvoffload_hal.hal.backend import DmaCopyBackend
from kvoffload_hal.plugins import load_class
from support import backend_doubles
from support.entry_points import install_entry_points


def _builtin_class(name):
    # The class itself, without the registry's "can it run here" check.
    return load_class("backend", name, registry._BUILTIN[name], DmaCopyBackend, RuntimeError)


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_registered_synchronous", {})


@pytest.mark.parametrize("name", sorted(registry._BUILTIN))
def test_each_built_in_declares_what_the_registry_says_of_it(name):
    cls = _builtin_class(name)
    assert cls.name == name
    # The registry's word for the scheduler is the class's own.
    assert registry.synchronous_compute(name) is cls.synchronous_compute
    assert cls.host_memcpy is (name == "cpu")
    assert (cls.runtime_name is None) is (name == "cpu")
    assert bool(cls.fallback_copy_paths) is (name != "cpu")
    for attr in ("copy_path", "runtime_version", "copy_path_is_fallback"):
        assert isinstance(getattr(cls, attr), property), attr


def test_the_abc_defaults_say_unknown_not_wrong():
    class Bare(backend_doubles.CountingCpuBackend):
        copy_path = DmaCopyBackend.copy_path
        runtime_version = DmaCopyBackend.runtime_version

    backend = Bare()
    assert backend.copy_path is None and not backend.copy_path_is_fallback
    assert backend.runtime_version is None
    backend.shutdown()


def test_a_registered_plug_in_says_whether_its_compute_is_synchronous():
    registry.register_backend("contract-sync", "nowhere:Backend", synchronous_compute=True)
    registry.register_backend("contract-async", "nowhere:Backend")
    # Neither target exists: nothing was imported to answer.
    assert registry.synchronous_compute("contract-sync") is True
    assert registry.synchronous_compute("contract-async") is False  # the safe default
    with pytest.raises(registry.BackendSelectionError, match="not a known backend"):
        registry.synchronous_compute("contract-none")


def test_an_entry_point_plug_in_declares_synchronous_compute_in_its_own_group(
        tmp_path, monkeypatch):
    backends, synchronous = registry.ENTRY_POINT_GROUP, registry.SYNCHRONOUS_GROUP
    install_entry_points(tmp_path, monkeypatch, {
        backends: {"ep-sync": "nowhere.a:Sync", "ep-async": "nowhere.a:Async",
                   "ep-other": "nowhere.a:Other"},
        synchronous: {"ep-sync": "nowhere.a:Sync", "ep-other": "elsewhere:Other"}})
    assert registry.synchronous_compute("ep-sync") is True
    assert registry.synchronous_compute("ep-async") is False  # undeclared
    assert registry.synchronous_compute("ep-other") is False  # declared for another target


def test_auto_follows_the_platform_vllm_runs_the_forward_pass_on(monkeypatch):
    from vllm.platforms import current_platform

    assert registry.synchronous_compute("auto") is current_platform.is_cpu()
    monkeypatch.setenv(registry.ENV_VAR, "")
    assert registry.synchronous_compute() is current_platform.is_cpu()


_RESOLVE_AS_THE_SCHEDULER_DOES = r"""
import json, sys
from types import SimpleNamespace

import torch
from kvoffload_hal.capabilities import resolve_capabilities
from kvoffload_hal.config import OffloadConfig
from vllm.platforms import current_platform

# As in the engine, vLLM and its platform are loaded before the connector is built (on
# their own they may load a CUDA runtime, and transformers imports an installed torch_npu).
platform_is_cpu = current_platform.is_cpu()
groups = SimpleNamespace(kv_cache_groups=[
    SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))])
config = OffloadConfig.from_extra_config({})

def libraries():
    with open("/proc/self/maps") as f:
        names = {line.rsplit("/", 1)[-1] for line in f.read().splitlines() if "/" in line}
    return {n for n in names if n.startswith(("libcuda", "libascendcl", "libacl"))}

modules, libs = set(sys.modules), libraries()
try:
    outcome = resolve_capabilities(groups, config).synchronous_compute
except Exception as e:  # the old code imported the backend, which cannot run here
    outcome = f"{type(e).__name__}: {e}"
print(json.dumps({
    "backend_modules": sorted(m for m in sys.modules if m.startswith("kvoffload_hal.backends")),
    "vendor_modules": sorted(m for m in set(sys.modules) - modules
                             if m.split(".")[0] in ("torch_npu", "cuda", "acl")),
    "libraries": sorted(libraries() - libs),
    "cuda_initialized": torch.cuda.is_initialized(),
    "synchronous_compute": outcome,
    "platform_is_cpu": platform_is_cpu,
}))
"""


@pytest.mark.parametrize("backend", ["cuda", "npu", "auto"])
def test_the_scheduler_side_imports_no_backend(backend, tmp_path):
    """Resolving the capabilities, as the scheduler process does, loads no backend
    module, no torch_npu and no vendor library, whatever backend is selected.

    An importable (empty) torch_npu is on the path, so that importing it would show."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, KVOFFLOAD_HAL_BACKEND=backend, PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", _RESOLVE_AS_THE_SCHEDULER_DOES],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    platform_is_cpu = found.pop("platform_is_cpu")
    expected = platform_is_cpu if backend == "auto" else False
    assert found == {"backend_modules": [], "vendor_modules": [], "libraries": [],
                     "cuda_initialized": False, "synchronous_compute": expected}
