"""jaxckpt: multi-level, fault-tolerant checkpoints for JAX.

The public API, re-exported from its modules. Names are resolved on first use
(PEP 562) so that processes which never touch JAX, such as the snapshot agent,
do not pay for importing it.
"""

import importlib
from typing import TYPE_CHECKING, Any

from jaxckpt import errors

_EXPORTS = {
    "AgentOptions": "jaxckpt.options",
    "CheckpointManager": "jaxckpt.manager",
    "CheckpointOptions": "jaxckpt.options",
    "LeafMetadata": "jaxckpt.restore._read",
    "ParityOptions": "jaxckpt.parity.placement",
    "RestoreInfo": "jaxckpt.restore._read",
    "SaveStats": "jaxckpt.manager",
    "StepMetadata": "jaxckpt.restore._read",
}
_SUBPACKAGES = ("ft", "parity", "universal")

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES, "errors"])
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  if name in _SUBPACKAGES:
    return importlib.import_module(f"jaxckpt.{name}")
  raise AttributeError(f"module 'jaxckpt' has no attribute {name!r}")


if TYPE_CHECKING:
  from jaxckpt import ft, parity, universal  # noqa: F401
  from jaxckpt.restore._read import LeafMetadata, RestoreInfo, StepMetadata  # noqa: F401
  from jaxckpt.manager import CheckpointManager, SaveStats  # noqa: F401
  from jaxckpt.options import AgentOptions, CheckpointOptions  # noqa: F401
  from jaxckpt.parity.placement import ParityOptions  # noqa: F401
