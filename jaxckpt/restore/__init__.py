"""Restore: choosing a step and its tier, and reading it onto a target.

``_tiers.restore`` is the one place a restore chooses its step and its fastest
tier (host, parity, storage) and reads it; ``_read`` holds the ``Source`` and
``Piece`` protocols, ``Tier`` and the records a restore reports
(``RestoreInfo``, ``StepMetadata``, ``LeafMetadata``, exported by ``jaxckpt``).
Each array is built from the pieces its devices need by :mod:`jaxckpt.arrays`.
"""
