"""Device -> host capture: shard selection, async copies, checksums."""

from jaxckpt.capture._copy import complete, start, warm_up
from jaxckpt.capture._plan import CapturePlan, Planner, ShardSlot, sharding_info

__all__ = ["CapturePlan", "Planner", "ShardSlot", "complete", "sharding_info", "start", "warm_up"]
