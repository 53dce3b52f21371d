"""Replica groups as units of fault tolerance (FT-HSDP): lighthouse, fault-tolerant all-reduce, catch-up."""

from jaxckpt.ft._allreduce import reference_mean
from jaxckpt.ft.agent_source import AgentSnapshotSource
from jaxckpt.ft.catch_up import InMemorySnapshotSource, RemoteSnapshotSource, SnapshotSource, replay
from jaxckpt.ft.lighthouse import Lighthouse, LighthouseClient, LighthouseOptions, Member, Quorum
from jaxckpt.ft.metrics import FtCounters, StepMetrics
from jaxckpt.ft.replica_group import ReplicaGroup, ReplicaGroupOptions, batch_index
from jaxckpt.ft.ring import INITIAL_DIGEST, GradientRing, RingEntry, chain_digest

__all__ = [
    "AgentSnapshotSource", "INITIAL_DIGEST", "FtCounters", "GradientRing", "InMemorySnapshotSource", "Lighthouse",
    "LighthouseClient", "LighthouseOptions", "Member", "Quorum", "RemoteSnapshotSource",
    "ReplicaGroup", "ReplicaGroupOptions", "RingEntry", "SnapshotSource", "StepMetrics",
    "batch_index", "chain_digest", "reference_mean", "replay",
]
