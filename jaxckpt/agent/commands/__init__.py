"""The agent's command lines: ``jaxckpt agent ...`` (``cli``), ``jaxckpt status``
(``status_cli``, over ``jobs``: every agent of a job, as its map names them) and
``jaxckpt delete`` (``delete_cli``). They are clients of agents over the wire, as a
trainer is; ``cli serve`` runs the agent process itself."""
