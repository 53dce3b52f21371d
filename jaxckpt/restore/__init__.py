"""Restore: choosing a step and its tier, and reading it onto a target.

``_tiers.restore`` is the one place a restore chooses its step and its fastest
tier (host, parity, storage) and reads it; ``_read`` holds the ``Source``
protocol (a step on one tier; a host store's pieces are ``host.store.Piece``),
``Tier`` and the records a restore reports (``RestoreInfo``, ``StepMetadata``,
``LeafMetadata``, exported by ``jaxckpt``).
Each array is built from the pieces its devices need by :mod:`jaxckpt.arrays`.
"""
