"""The trainer's side of the agent: what runs in the training process. ``client``
(``AgentStore``: the host store a manager saves through, and ``start_agent``), the
job's agents (``_job_agents``, ``_remote``), the slots the trainer maps
(``_slot_maps``), a dead peer's persists taken over (``_repersist``) and a lost host
rebuilt from parity (``_parity_recovery``), and which agents a manager uses
(``_factory``). It speaks to the agent process only through the wire
(``jaxckpt.agent._requests``, ``_protocol``), never imports it."""
