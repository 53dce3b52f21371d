"""Moved to :mod:`jaxckpt.host.snapshot`; this name stays so that code written against
``jaxckpt.snapshot`` keeps working: it is the same module object."""

import sys

from jaxckpt.host import snapshot as _moved

sys.modules[__name__] = _moved
