"""The manager's core: the tiers around one step ledger, and one policy.

- ``_manager``: :class:`CoreManager`, what :class:`jaxckpt.CheckpointManager` wraps:
  saves, restores and deletes across the tiers.
- ``_ledger``: one record of every step (in flight, due, persisting, on storage,
  kept or dropped and why, its time and metrics) and the manager's ``stats``.
- ``_policy``: which steps are saved and which are kept, whichever options built it.
- ``_schedule`` and ``_flow``: the job's plan of which save calls snapshot and
  which persist, and a manager's flow of saves against its store.
- ``_persists``: the trainer's view of its persists (errors, waits).
"""
