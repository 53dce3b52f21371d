"""Per-step observability of a replica group."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
  """What happened in one step attempt of one replica group.

  Attributes:
    step: the committed step the attempt started from.
    attempt: index of the attempt (counts every ``start_step``/``allreduce``).
    quorum_id: id of the attempt's quorum, None if none formed in time.
    quorum_size: number of groups in the quorum.
    contributors: groups whose gradients are in the committed average.
    dropped_groups: groups of the previous quorum or of this one that are not
      contributors of this step.
    committed: whether the step was committed by this group.
    failure: why not, when the all-reduce did not complete (a piece that did not
      arrive, a neighbour that failed first, gradients whose tree structure,
      shapes or dtypes differ from a member's: named with that member).
    retries: failed attempts in a row before this one at the same step.
    quorum_secs: time spent waiting for the quorum.
    allreduce_secs: time spent in the fault-tolerant all-reduce.
    catch_up_secs: time spent catching up (fetch and replay), 0 if none.
    caught_up_steps: steps replayed in this attempt's catch-up.
    snapshot_step: step of the snapshot fetched during catch-up, or None.
  """
  step: int
  attempt: int
  quorum_id: str | None = None
  quorum_size: int = 0
  contributors: tuple[str, ...] = ()
  dropped_groups: tuple[str, ...] = ()
  committed: bool = False
  failure: str | None = None
  retries: int = 0
  quorum_secs: float = 0.0
  allreduce_secs: float = 0.0
  catch_up_secs: float = 0.0
  caught_up_steps: int = 0
  snapshot_step: int | None = None


@dataclasses.dataclass(slots=True)
class FtCounters:
  """Running totals over the life of a replica group."""
  attempts: int = 0
  commits: int = 0
  failed_attempts: int = 0
  dropped_groups: int = 0
  catch_ups: int = 0
  snapshot_fetches: int = 0
  catch_up_secs: float = 0.0
