"""The agent process (``python -m jaxckpt.agent serve``): one host's snapshots in shared
memory, its requests (``_server``) and the parts that handle them: the slots' files
(``_slot_files``), the readers (``_reads``), persists and parity (``_durability``,
``_parity_worker``) and what the job's other hosts hold (``_job_keep``). It imports no
JAX, and nothing of the trainer's side (``jaxckpt.agent.trainer``) or the commands."""
