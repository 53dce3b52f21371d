"""Reed-Solomon parity across hosts: the codec (bytes only), placement, recovery.

Imports no JAX and nothing of jaxckpt but ``errors`` and ``snapshot.checksum``.
"""

from jaxckpt.parity.codec import ReedSolomon
from jaxckpt.parity.placement import (ParityOptions, Piece, Stripe, StripeLayout, check_hosts,
                                      encode_stripe, groups)
from jaxckpt.parity.recovery import (check_recoverable, piece_checksums, rebuild_ranges,
                                     recover_hosts)

__all__ = [
    "ParityOptions",
    "Piece",
    "ReedSolomon",
    "Stripe",
    "StripeLayout",
    "check_hosts",
    "check_recoverable",
    "encode_stripe",
    "groups",
    "piece_checksums",
    "rebuild_ranges",
    "recover_hosts",
]
