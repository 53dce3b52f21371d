"""What a trainer tells its agent about parity (:class:`ParityConfig`), shared by the
agent's parity thread (:mod:`jaxckpt.agent.server._parity_worker`) and the trainer's view of
parity (:mod:`jaxckpt.agent.trainer._parity_recovery`).

Hosts are the saving processes: parity needs each agent's host id to equal
its trainer's ``jax.process_index()`` (the default).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from jaxckpt.parity.placement import ParityOptions


def _lib() -> Any:
  """``jaxckpt.parity``, imported on first use: its compiled codec takes a while to
  load, and an agent answers its trainer's hello before that (see ParityWorker)."""
  import jaxckpt.parity  # pylint: disable=import-outside-toplevel
  return jaxckpt.parity


@dataclasses.dataclass(frozen=True)
class ParityConfig:
  """What the trainer tells its agent at hello (``CheckpointOptions.parity``)."""

  group_size: int
  parity: int
  timeout_secs: float = 300.0
  poll_secs: float = 0.005
  sub_block_bytes: int = 4 << 20     # pulled and encoded per data host at a time

  @property
  def options(self) -> ParityOptions:
    return _lib().ParityOptions(group_size=self.group_size, parity=self.parity)

  def to_obj(self) -> dict[str, Any]:
    return dataclasses.asdict(self)
