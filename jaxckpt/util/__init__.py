"""Small process-level helpers of the trainer and the agent: the one wait with a deadline
(``_wait``) and the preemption notice (``_preemption``)."""
