"""The host tier: snapshots held in host memory between steps.

- :mod:`jaxckpt.host.store`: ``HostStore``, the interface the manager uses (the
  in-process store here, the snapshot agent in :mod:`jaxckpt.agent.trainer.client`), and
  ``InProcessStore``.
- :mod:`jaxckpt.host.snapshot`: the records of a snapshot (manifest, leaves,
  shards, boxes) and its checksums, shared by every tier.
- ``_slots``: the one slot table both stores decide with; ``_persist``: the one
  persist queue (host memory to the universal format), run by whichever process
  holds the bytes; ``_spans``: checksums of a slot's spans as they are written.

Nothing here imports JAX: the snapshot agent runs this code without it.
"""
