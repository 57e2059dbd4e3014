"""The ctypes ACL declarations against acl_rt_decls.h, the header the fake is built from.

CANN's own headers are not on a package index, so acl_rt_decls.h states each
declaration with the CANN version and document it comes from; this test ties
``kvoffload_hal.backends.npu._acl`` to it field by field, and the fake runtime
is compiled against the same header, so neither side can drift alone.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvoffload_hal.backends.npu import _acl
from support.abi_probe import ctypes_layout, layout_mismatches, run_probe

HEADER = Path(__file__).with_name("acl_rt_decls.h")

# C type -> the ctypes type the bindings use for it.
TYPES = {
    "aclrtMemLocation": _acl.AclMemLocation,
    "aclrtMemcpyBatchAttr": _acl.AclMemcpyBatchAttr,
    "aclError": ctypes.c_int,  # every binding's restype
    "aclrtMemcpyKind": ctypes.c_int,  # aclrtMemcpyAsync's kind argument
    "aclrtMemLocationType": ctypes.c_int,
    "aclrtStream": ctypes.c_void_p,
}

# C constant -> the value the bindings use.
CONSTANTS = {
    "ACL_SUCCESS": _acl.ACL_SUCCESS,
    "ACL_ERROR_RT_FEATURE_NOT_SUPPORT": _acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    "ACL_ERROR_RT_MEMORY_ALLOCATION": _acl.ACL_ERROR_RT_MEMORY_ALLOCATION,
    "ACL_MEM_LOCATION_TYPE_HOST": _acl.ACL_MEM_LOCATION_TYPE_HOST,
    "ACL_MEM_LOCATION_TYPE_DEVICE": _acl.ACL_MEM_LOCATION_TYPE_DEVICE,
    "ACL_MEMCPY_HOST_TO_DEVICE": _acl.ACL_MEMCPY_HOST_TO_DEVICE,
    "ACL_MEMCPY_DEVICE_TO_HOST": _acl.ACL_MEMCPY_DEVICE_TO_HOST,
}


def test_every_ctypes_layout_and_constant_matches_acl_rt_decls_h(tmp_path):
    expected = {name: ctypes_layout(name, t) for name, t in TYPES.items()}
    actual, values = run_probe(tmp_path, [f'"{HEADER.name}"'], [HEADER.parent], expected,
                               CONSTANTS)
    flat = {path: v for layout in expected.values() for path, v in layout.items()}
    assert len(flat) == 15  # 6 types; 2 + 7 fields, the nested id/type of dstLoc and srcLoc too
    assert layout_mismatches(flat, actual, HEADER.name) == []
    assert values == CONSTANTS
