"""jaxckpt: multi-level, fault-tolerant checkpoints for JAX."""

from jaxckpt import errors
from jaxckpt._restore import RestoreInfo
from jaxckpt.manager import CheckpointManager, SaveStats
from jaxckpt.options import AgentOptions, CheckpointOptions

__all__ = ["AgentOptions", "CheckpointManager", "CheckpointOptions", "RestoreInfo", "SaveStats", "errors"]
__version__ = "0.1.0"
