"""The per-host snapshot agent: a process that owns host snapshots in shared memory."""

from jaxckpt.agent._remote import RemotePiece, job_agents
from jaxckpt.agent.client import AgentStore, start_agent

__all__ = ["AgentStore", "RemotePiece", "job_agents", "start_agent"]
