"""Vendor backends of the HAL, installed as ``kvoffload_hal.backends``.

Each subpackage imports its vendor runtime lazily, inside the backend, so
importing a subpackage never fails on a machine without that device.
"""
