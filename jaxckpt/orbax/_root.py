"""orbax's root metadata (``CheckpointManager(metadata=...)``), beside the steps."""

from __future__ import annotations

from typing import Any

from jaxckpt import universal
from jaxckpt.core._policy import DirectoryRules

ROOT_METADATA = "root_metadata.json"


class RootMetadata:
  """A manager's root metadata: written once by process 0 (a later manager's is
  ignored), unless read-only or ``save_root_metadata=False``; read back as orbax's
  ``RootMetadata``."""

  def __init__(self, directory: str | None, given: Any, rules: DirectoryRules,
               process_index: int) -> None:
    self.directory, self.rules = directory, rules
    self.given = None if given is None else dict(given)
    if (self.given is not None and directory is not None and not rules.read_only
        and rules.save_root_metadata and process_index == 0
        and universal.read_json(directory, ROOT_METADATA) is None):
      universal.write_json(directory, ROOT_METADATA, {"custom_metadata": self.given})

  def read(self) -> Any:
    """orbax's ``RootMetadata``: the stored root metadata, else the given one (read-only
    managers and ``save_root_metadata=False`` never store it)."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel  (orbax's own type, only for its users)
    stored = None if self.directory is None else universal.read_json(self.directory,
                                                                     ROOT_METADATA)
    if stored is not None:
      return ocp.metadata.RootMetadata(custom_metadata=stored.get("custom_metadata") or {})
    given = self.given if self.rules.read_only or self.directory is None else None
    return ocp.metadata.RootMetadata(custom_metadata=dict(given or {}))
