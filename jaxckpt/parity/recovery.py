"""Rebuilding lost hosts' snapshots from the survivors' pieces, checksum-verified.

Every piece has a saved checksum (:func:`piece_checksums`, xxh3-64 from
``jaxckpt.host.snapshot.checksum``): data pieces over their own bytes, parity
pieces over the whole block. Recovery verifies every piece it fetches and
every piece it rebuilds, so a corrupted piece is never decoded into garbage:
a piece that fails its checksum is left out and the next survivor is fetched
instead (a stripe with more than k survivors tolerates it).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxckpt import errors
from jaxckpt.host.snapshot import checksum
from jaxckpt.parity import codec as codec_lib
from jaxckpt.parity.placement import Piece, Stripe, StripeLayout, padded

logger = logging.getLogger(__name__)

Fetch = Callable[[Piece], Any]
_STRIPES_AT_ONCE = 4


def piece_checksums(pieces: Sequence[Piece], bufs: Sequence[Any]) -> dict[Piece, str]:
  """Checksums of pieces (data: their ``nbytes``; parity: the whole block)."""
  if len(pieces) != len(bufs):
    raise errors.InvalidArgumentError(f"got {len(pieces)} pieces but {len(bufs)} buffers")
  out = {}
  for piece, buf in zip(pieces, bufs):
    arr = codec_lib.as_u8(buf, name=f"piece {piece}")
    if arr.size != piece.nbytes:
      raise errors.InvalidArgumentError(f"piece {piece} is {piece.nbytes} bytes, got a buffer of {arr.size}")
    out[piece] = checksum(arr)
  return out


def check_recoverable(layout: StripeLayout, lost_hosts: Sequence[int]) -> None:
  """Raises UnrecoverableLossError if some group lost more hosts than its parity.

  Raises:
    UnrecoverableLossError: naming every such group and its lost hosts.
    ValueError: a host id outside the layout.
  """
  lost = set(lost_hosts)
  unknown = sorted(h for h in lost if not 0 <= h < len(layout.host_bytes))
  if unknown:
    raise errors.InvalidArgumentError(f"lost hosts {unknown} are not in the layout of {len(layout.host_bytes)} hosts")
  m = layout.options.parity
  bad = [(gid, hosts, sorted(lost.intersection(hosts)))
         for gid, hosts in enumerate(layout.groups) if len(lost.intersection(hosts)) > m]
  if bad:
    detail = "; ".join(f"group {gid} (hosts {list(hosts)}) lost hosts {gone}"
                       for gid, hosts, gone in bad)
    raise errors.UnrecoverableLossError(
        f"parity={m} rebuilds at most {m} lost host(s) per group, but {detail}; "
        "restore this step from storage instead")


def recover_hosts(layout: StripeLayout, lost_hosts: Sequence[int], fetch: Fetch,
                  checksums: Mapping[Piece, str]) -> dict[int, np.ndarray]:
  """Rebuilds the snapshots of lost hosts from their groups' survivors.

  Args:
    layout: The layout the parity was made with.
    lost_hosts: Hosts whose snapshots are gone.
    fetch: Returns a surviving piece's bytes (data: ``piece.nbytes`` bytes of
      the host's snapshot; parity: the block), or None if it cannot.
      Pieces of lost hosts are never fetched; survivors are fetched data
      first, and only until k verified pieces per stripe are in hand.
    checksums: The saved checksum of every piece (:func:`piece_checksums`).

  Returns:
    {lost host: its snapshot bytes}, byte-exact and checksum-verified.

  Raises:
    UnrecoverableLossError: more hosts of a group lost than parity, or too few
      survivors could be fetched.
    CorruptSnapshotError: too few survivors passed their checksums, or a
      rebuilt piece failed its checksum.
  """
  check_recoverable(layout, lost_hosts)
  lost = set(lost_hosts)
  result = {h: np.empty(layout.host_bytes[h], np.uint8) for h in sorted(lost)}
  todo = [s for s in layout.stripes
          if any(p.host in lost and p.nbytes for p in s.data)]   # (a lost empty piece is rebuilt)
  # Stripes rebuild side by side, each writing its own bytes of ``result``
  # (fetches, xxhash over large buffers and decoding leave the GIL).
  with concurrent.futures.ThreadPoolExecutor(_STRIPES_AT_ONCE) as pool:
    for f in [pool.submit(_recover_stripe, s, lost, fetch, checksums, result) for s in todo]:
      f.result()
  return result


def _recover_stripe(stripe: Stripe, lost: set[int], fetch: Fetch,
                    checksums: Mapping[Piece, str], result: dict[int, np.ndarray]) -> None:
  k = len(stripe.data)
  blocks: list[np.ndarray | None] = [None] * len(stripe.pieces)
  bad: list[str] = []
  survivors = [p for p in stripe.pieces if p.host not in lost]
  with concurrent.futures.ThreadPoolExecutor(k) as pool:    # the first k at once, from k hosts
    first = list(pool.map(lambda p: _fetch_verified(p, fetch, checksums, bad), survivors[:k]))
  for piece, buf in zip(survivors[:k], first):
    if buf is not None:
      blocks[piece.slot] = padded(buf, stripe.block_bytes)
  for piece in survivors[k:]:                               # stand-ins for failed ones
    if sum(b is not None for b in blocks) == k:
      break
    buf = _fetch_verified(piece, fetch, checksums, bad)
    if buf is not None:
      blocks[piece.slot] = padded(buf, stripe.block_bytes)
  if sum(b is not None for b in blocks) < k:
    _raise_short(stripe, lost, bad)
  out, short = {}, {}  # short: rebuilt into a scratch block (padded or not wanted)
  for piece in stripe.data:
    if blocks[piece.slot] is not None:
      continue
    if piece.host in lost and piece.nbytes == stripe.block_bytes:
      out[piece.slot] = result[piece.host][piece.start:piece.stop]
    else:
      out[piece.slot] = short[piece.slot] = np.empty(stripe.block_bytes, np.uint8)
  codec_lib.codec(k, len(stripe.parity)).decode_into(blocks, out)
  for piece in stripe.data:
    if piece.host in lost:
      if piece.slot in short:
        result[piece.host][piece.start:piece.stop] = short[piece.slot][:piece.nbytes]
      _verify_rebuilt(piece, result[piece.host][piece.start:piece.stop], checksums)


def _fetch_verified(piece: Piece, fetch: Fetch, checksums: Mapping[Piece, str],
                    bad: list[str]) -> Any:
  buf = fetch(piece)
  if buf is None:
    bad.append(f"{piece} could not be fetched")
    return None
  got = checksum(codec_lib.as_u8(buf, name=f"piece {piece}"))
  want = checksums.get(piece)
  if got != want:
    logger.warning("piece %s failed its checksum (%s != saved %s); leaving it out",
                   piece, got, want)
    bad.append(f"{piece} failed its checksum ({got} != saved {want})")
    return None
  return buf


def _raise_short(stripe: Stripe, lost: set[int], bad: list[str]) -> None:
  gone = sorted(lost.intersection(p.host for p in stripe.pieces))
  msg = (f"stripe {stripe.id} of group {stripe.group} lost hosts {gone} and has fewer "
         f"than k={len(stripe.data)} usable survivors: {'; '.join(bad)}; restore this "
         "step from storage instead")
  if any("checksum" in b for b in bad):
    raise errors.CorruptSnapshotError(msg)
  raise errors.UnrecoverableLossError(msg)


def _verify_rebuilt(piece: Piece, buf: np.ndarray, checksums: Mapping[Piece, str]) -> None:
  got, want = checksum(buf), checksums.get(piece)
  if got != want:
    raise errors.CorruptSnapshotError(
        f"rebuilt piece {piece} has checksum {got} but {want} was saved: the saved "
        "checksums or the parity do not match this step; restore it from storage instead")
