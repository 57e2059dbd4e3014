"""``python -m kvoffload_hal.selfcheck``: see :mod:`kvoffload_hal.selfcheck`."""

import sys

from kvoffload_hal.selfcheck import main

sys.exit(main())
