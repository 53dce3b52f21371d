"""Reed-Solomon parity across hosts: the codec (bytes only), placement, recovery.

Imports no JAX and nothing of jaxckpt but ``errors`` and ``snapshot.checksum``.
"""

from jaxckpt.parity.codec import ReedSolomon

__all__ = [
    "ReedSolomon",
]
