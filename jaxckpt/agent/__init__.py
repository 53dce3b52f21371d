"""The per-host snapshot agent: a process that owns host snapshots in shared memory.

Three rooms, each a program of its own: ``server/`` (the agent process), ``trainer/``
(what runs in the trainer: ``AgentStore``) and ``commands/`` (the command lines); the
wire they share sits here (``_requests``, ``_protocol``, ``_paths``, ``_parity_config``).
The modules' paths from before the rooms (``jaxckpt.agent.client``, ``jaxckpt.agent.cli``,
``jaxckpt.agent._server``, ...) stay importable: each is the moved module itself
(``MOVED``), so code written against them, and other branches, keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

#: Each module's room, by its name from before the rooms.
MOVED = {
    **dict.fromkeys(("_server", "_reads", "_durability", "_slot_files", "_parity_worker",
                     "_job_keep"), "server"),
    **dict.fromkeys(("client", "_job_agents", "_repersist", "_slot_maps", "_remote",
                     "_parity_recovery", "_factory"), "trainer"),
    **dict.fromkeys(("cli", "status_cli", "delete_cli", "jobs"), "commands"),
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """``jaxckpt.agent.X`` for a moved ``X``: the module ``jaxckpt.agent.<room>.X`` itself
  (one module object under both names, so a patch of one is a patch of the other)."""

  def find_spec(self, name: str, path: object = None,
                target: object = None) -> importlib.machinery.ModuleSpec | None:
    parent, _, short = name.rpartition(".")
    if parent != __name__ or short not in MOVED:
      return None
    return importlib.util.spec_from_loader(name, self)

  def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    short = spec.name.rpartition(".")[2]
    return importlib.import_module(f"{__name__}.{MOVED[short]}.{short}")

  def exec_module(self, module: types.ModuleType) -> None:
    del module                       # (the moved module ran when it was imported)


if not any(isinstance(f, _Moved) for f in sys.meta_path):
  sys.meta_path.insert(0, _Moved())

from jaxckpt.agent.trainer._remote import RemotePiece, job_agents  # noqa: E402
from jaxckpt.agent.trainer.client import AgentStore, start_agent  # noqa: E402

__all__ = ["AgentStore", "RemotePiece", "job_agents", "start_agent"]
