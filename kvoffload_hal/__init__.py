"""kvoffload_hal: KV-cache offloading for vLLM over a hardware-abstraction layer.

Importing this package loads no device runtime and does not need vLLM; the
connector (``kvoffload_hal.connector``) imports vLLM when it is used.
"""

__version__ = "0.1.0"
