"""The jaxckpt error hierarchy.

Every error is a :class:`JaxckptError` and also the builtin that fits it, so
callers can catch either ``jaxckpt.errors.StepNotFoundError`` or plain
``FileNotFoundError``. Messages say what went wrong, the offending values, and
what to do about it.
"""

from __future__ import annotations

from jaxckpt.util._text import shown


class JaxckptError(Exception):
  """Root of every error raised by jaxckpt. Its message is printable text: a name from
  a checkpoint or a peer in it (an escape sequence, a newline) is shown escaped, so
  no traceback, log line or command's error writes control sequences to a terminal."""

  def __str__(self) -> str:
    return shown(super().__str__())


class UnsupportedLeafError(JaxckptError, TypeError):
  """A pytree leaf has a type that jaxckpt cannot snapshot."""


class StructureMismatchError(JaxckptError, ValueError):
  """A restore target does not match the saved tree (structure, shape or dtype)."""


class StepNotFoundError(JaxckptError, FileNotFoundError):
  """The requested step is not held by any tier."""


class ManagerClosedError(JaxckptError, RuntimeError):
  """An operation was attempted on a closed CheckpointManager."""


class CorruptSnapshotError(JaxckptError, OSError):
  """Stored bytes do not match their checksum (torn, truncated or corrupted)."""


class SnapshotTimeoutError(JaxckptError, TimeoutError):
  """A wait ran past its timeout; the message names who was late."""


class HostMemoryBudgetError(JaxckptError, MemoryError):
  """Snapshots would not fit in the configured host-memory budget."""


class AgentUnavailableError(JaxckptError, ConnectionError):
  """The snapshot agent could not be reached or died."""


class UnrecoverableLossError(JaxckptError, RuntimeError):
  """More hosts of a parity group were lost than parity can rebuild."""


class ParityError(JaxckptError, RuntimeError):
  """A step's parity failed on a host and will not be retried (the host and why are named)."""


class ConversionError(JaxckptError, ValueError):
  """A conversion rule is invalid, unmatched or ambiguous."""


class ManifestError(JaxckptError, ValueError):
  """A checkpoint manifest is missing, malformed or of an unknown version."""


class QuorumError(JaxckptError, RuntimeError):
  """A replica-group quorum could not be formed or was lost."""


class TermsMismatchError(QuorumError, ValueError):
  """A replica group's max_groups, data order, tree layout or averaging rule differs
  from its job's: it is refused when it joins (the message names the field and both values)."""


class StepExistsError(JaxckptError, FileExistsError):
  """A step is already committed in storage and would be overwritten."""


class StepAlreadyExistsError(StepExistsError, ValueError):
  """``save(step)`` of a step that a tier already holds (orbax's error of the same name, a
  ValueError; with orbax installed, the manager raises a subclass that is also orbax's)."""


class ItemNotFoundError(StructureMismatchError, FileNotFoundError):
  """A restore asked for an item that the step does not hold (orbax raises FileNotFoundError)."""


class InvalidArgumentError(JaxckptError, ValueError):
  """An argument or option has a value jaxckpt cannot use (the message names it and the fix)."""


class StorageError(JaxckptError, OSError):
  """Writing to or reading from storage failed (the message names the path and the cause)."""


class PermissionDeniedError(JaxckptError, PermissionError):
  """Refused for safety: a request without the job's secret, a run root that other users
  could write, or a second live trainer of one job and host."""
