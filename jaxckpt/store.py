"""Moved to :mod:`jaxckpt.host.store`; this name stays so that code written against
``jaxckpt.store`` keeps working: it is the same module object."""

import sys

from jaxckpt.host import store as _moved

sys.modules[__name__] = _moved
