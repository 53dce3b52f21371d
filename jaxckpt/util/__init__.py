"""Small process-level helpers of the trainer and the agent: the one wait with a deadline
(``_wait``), the preemption notice (``_preemption``), and the progress of long reads and
writes (``_progress``: a bar on a terminal, log lines otherwise), and the JSON written to
storage (``_json``). No JAX."""
