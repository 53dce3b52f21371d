"""jaxckpt: multi-level, fault-tolerant checkpoints for JAX."""

from jaxckpt import errors
from jaxckpt._restore import RestoreInfo
from jaxckpt.manager import CheckpointManager, SaveStats
from jaxckpt.options import CheckpointOptions

__all__ = ["CheckpointManager", "CheckpointOptions", "RestoreInfo", "SaveStats", "errors"]
__version__ = "0.1.0"
