"""Replica groups as units of fault tolerance (FT-HSDP): lighthouse, fault-tolerant all-reduce, catch-up.

Names are resolved on first use (PEP 562), so a process that only runs the
lighthouse (or a heartbeat) does not pay for importing JAX.
"""

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AgentSnapshotSource": "jaxckpt.ft.agent_source",
    "FtCounters": "jaxckpt.ft.metrics",
    "GradientRing": "jaxckpt.ft.ring",
    "INITIAL_DIGEST": "jaxckpt.ft.ring",
    "InMemorySnapshotSource": "jaxckpt.ft.catch_up",
    "Lighthouse": "jaxckpt.ft.lighthouse",
    "LighthouseClient": "jaxckpt.ft.lighthouse",
    "LighthouseOptions": "jaxckpt.ft.lighthouse",
    "Member": "jaxckpt.ft.lighthouse",
    "Quorum": "jaxckpt.ft.lighthouse",
    "RemoteSnapshotSource": "jaxckpt.ft.catch_up",
    "ReplicaGroup": "jaxckpt.ft.replica_group",
    "ReplicaGroupOptions": "jaxckpt.ft.replica_group",
    "RingEntry": "jaxckpt.ft.ring",
    "SnapshotSource": "jaxckpt.ft.catch_up",
    "StepMetrics": "jaxckpt.ft.metrics",
    "batch_index": "jaxckpt.ft.replica_group",
    "chain_digest": "jaxckpt.ft.ring",
    "reference_mean": "jaxckpt.ft._allreduce",
    "replay": "jaxckpt.ft.catch_up",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'jaxckpt.ft' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
  from jaxckpt.ft._allreduce import reference_mean  # noqa: F401
  from jaxckpt.ft.agent_source import AgentSnapshotSource  # noqa: F401
  from jaxckpt.ft.catch_up import InMemorySnapshotSource, RemoteSnapshotSource, SnapshotSource, replay  # noqa: F401
  from jaxckpt.ft.lighthouse import Lighthouse, LighthouseClient, LighthouseOptions, Member, Quorum  # noqa: F401
  from jaxckpt.ft.metrics import FtCounters, StepMetrics  # noqa: F401
  from jaxckpt.ft.replica_group import ReplicaGroup, ReplicaGroupOptions, batch_index  # noqa: F401
  from jaxckpt.ft.ring import INITIAL_DIGEST, GradientRing, RingEntry, chain_digest  # noqa: F401
