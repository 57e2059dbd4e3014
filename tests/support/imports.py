"""What importing some code loads into a fresh interpreter, beyond what torch loads itself.

A CUDA build of torch maps the CUDA runtime as it imports; the property the
tests check is that *our* imports add no vendor runtime: no vendor Python
module and no vendor shared library that was not mapped before they ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

VENDOR_MODULES = ("torch_npu", "cuda", "cupy", "pycuda", "acl")
VENDOR_LIBRARIES = ("libcuda.so", "libcudart", "libascendcl", "libacl")

_PROBE = textwrap.dedent("""
    import json, sys
    import torch

    def vendor_libs():
        with open("/proc/self/maps") as f:
            names = {line.rsplit("/", 1)[-1] for line in f.read().splitlines() if "/" in line}
        return {n for n in names if n.startswith(tuple(json.loads(sys.argv[1])))}

    before, modules_before = vendor_libs(), set(sys.modules)  # torch's own (a CUDA build's)
    exec(sys.argv[3])
    print(json.dumps({
        "modules": sorted(m for m in set(sys.modules) - modules_before
                          if m.split(".")[0] in json.loads(sys.argv[2])),
        "libraries": sorted(vendor_libs() - before),
        "cuda_initialized": torch.cuda.is_initialized(),
    }))
""")


def loaded_by(code: str, env: dict[str, str] | None = None) -> dict:
    """``{"modules", "libraries", "cuda_initialized"}`` added by running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(VENDOR_LIBRARIES), json.dumps(VENDOR_MODULES),
         textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
