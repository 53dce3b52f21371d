"""Rebuilding lost hosts' snapshots from the survivors' pieces, checksum-verified.

Every piece has a saved checksum (:func:`piece_checksums`, xxh3-64 from
``jaxckpt.host.snapshot.checksum``): data pieces over their own bytes, parity
pieces over the whole block. Recovery verifies every piece it fetches and
every piece it rebuilds, so a corrupted piece is never decoded into garbage:
a piece that fails its checksum is left out and the next survivor is fetched
instead (a stripe with more than k survivors tolerates it).

:func:`rebuild_ranges` rebuilds only some byte ranges of lost hosts (what a restore
onto another mesh needs of them), from the same ranges of their stripes' survivors.
Decoding is bytewise, so a range costs k times its bytes instead of the whole
host's k stripes; the pieces' checksums cover whole pieces, so the caller verifies
what it rebuilt (each shard against its manifest's checksum) and falls back to
:func:`recover_hosts` when that fails.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxckpt import errors
from jaxckpt.host.snapshot import checksum
from jaxckpt.parity import codec as codec_lib
from jaxckpt.parity.placement import Piece, Stripe, StripeLayout, padded

logger = logging.getLogger(__name__)

Fetch = Callable[[Piece], Any]
# Reads byte ranges of one host's surviving pieces: [(piece, lo, hi)] -> their bytes, or None
# if that host cannot serve them. A data piece's range is [piece.start + lo, piece.start + hi)
# of its host's snapshot, clipped to the piece (the rest is the stripe's zero padding); a
# parity piece's is [lo, hi) of its block.
FetchRanges = Callable[[int, Sequence[tuple[Piece, int, int]]], Sequence[Any] | None]
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


def rebuild_ranges(layout: StripeLayout, lost_hosts: Sequence[int],
                   wanted: Mapping[int, Sequence[tuple[int, int]]], fetch: FetchRanges,
                   out: Mapping[int, np.ndarray]) -> int:
  """Rebuilds byte ranges ``wanted[h]`` (``[(start, stop)]`` of host ``h``'s snapshot)
  of lost hosts into ``out[h]`` (a buffer of the host's snapshot size, for each host
  ``wanted`` names; other lost hosts' bytes decoded alongside are dropped), reading only
  the same ranges of the stripes they lie in: per stripe, the first k survivors (data
  first; another survivor stands in for a host that cannot serve), each host's ranges
  in one ``fetch``. Returns the bytes fetched.

  Nothing is verified here (a checksum covers a whole piece): the caller checks what
  it rebuilt, and rebuilds the host with :func:`recover_hosts` if that fails.

  Raises:
    UnrecoverableLossError: more hosts of a group lost than parity, or fewer than k
      survivors of a stripe could serve.
  """
  check_recoverable(layout, lost_hosts)
  lost = set(lost_hosts)
  need: dict[int, list[tuple[int, int]]] = {}     # stripe -> ranges of its blocks
  for h in sorted(lost):
    for piece in layout.data_pieces(h):
      for a, b in wanted.get(h, ()):
        lo, hi = max(a, piece.start), min(b, piece.stop)
        if lo < hi:
          need.setdefault(piece.stripe, []).append((lo - piece.start, hi - piece.start))
  # Each range cut where a data piece ends (past its end a piece is zeros: never read)
  plan = {sid: _cut(_merged(ranges), layout.stripes[sid]) for sid, ranges in need.items()}
  used: dict[int, list[Piece]] = {}               # stripe -> the survivors read for it
  got: dict[tuple[Piece, int, int], np.ndarray] = {}
  down: set[int] = set()                          # hosts that could not serve
  fetched = 0
  while True:
    asks: dict[int, list[tuple[Piece, int, int]]] = {}
    for sid, ranges in plan.items():
      stripe = layout.stripes[sid]
      k = len(stripe.data)
      have = [p for p in used.get(sid, []) if p.host not in down]
      for p in [p for p in stripe.pieces if p.host not in lost | down and p not in have]:
        if len(have) == k:
          break
        have.append(p)
      if len(have) < k:
        gone = sorted(lost.intersection(p.host for p in stripe.pieces))
        raise errors.UnrecoverableLossError(
            f"stripe {sid} of group {stripe.group} lost hosts {gone}, and hosts "
            f"{sorted(down.intersection(p.host for p in stripe.pieces))} could not serve "
            f"its survivors' bytes: fewer than k={k} left; restore this step from storage "
            "instead")
      used[sid] = have
      for p in have:
        asks.setdefault(p.host, []).extend(
            (p, lo, hi) for lo, hi in ranges
            if (p, lo, hi) not in got and not (_is_data(stripe, p) and lo >= p.nbytes))
    asks = {h: a for h, a in asks.items() if a}
    if not asks:
      break
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:   # hosts at once
      replies = dict(zip(asks, pool.map(lambda h: fetch(h, asks[h]), asks)))
    for h, bufs in replies.items():
      if bufs is None:
        down.add(h)
        continue
      for (p, lo, hi), buf in zip(asks[h], bufs):
        arr = codec_lib.as_u8(buf, name=f"range [{lo}, {hi}) of {p}")
        fetched += arr.size
        got[(p, lo, hi)] = padded(arr, hi - lo)     # (cut at its end: its size already)
  # Ranges decode side by side, each writing its own bytes of ``out`` (the codec leaves
  # the GIL).
  with concurrent.futures.ThreadPoolExecutor(_STRIPES_AT_ONCE) as pool:
    for f in [pool.submit(_decode_range, layout.stripes[sid], lo, hi, used[sid], got, out)
              for sid, ranges in plan.items() for lo, hi in ranges]:
      f.result()
  return fetched


def _is_data(stripe: Stripe, piece: Piece) -> bool:
  return piece.slot < len(stripe.data)


def _cut(ranges: list[tuple[int, int]], stripe: Stripe) -> list[tuple[int, int]]:
  """``ranges`` of ``stripe``'s blocks cut where a data piece ends inside one."""
  ends = sorted({p.nbytes for p in stripe.data})
  out = []
  for lo, hi in ranges:
    for end in ends:
      if lo < end < hi:
        out.append((lo, end))
        lo = end
    out.append((lo, hi))
  return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """``ranges`` sorted, overlapping or touching ones joined."""
  out: list[list[int]] = []
  for lo, hi in sorted(ranges):
    if out and lo <= out[-1][1]:
      out[-1][1] = max(out[-1][1], hi)
    else:
      out.append([lo, hi])
  return [(lo, hi) for lo, hi in out]


@functools.lru_cache(maxsize=8)
def _zeros(nbytes: int) -> np.ndarray:
  """A read-only block of zeros (the bytes of a data piece past its end)."""
  out = np.zeros(nbytes, np.uint8)
  out.flags.writeable = False
  return out


def _decode_range(stripe: Stripe, lo: int, hi: int, used: list[Piece],
                  got: Mapping[tuple[Piece, int, int], np.ndarray],
                  out: Mapping[int, np.ndarray]) -> None:
  """Range ``[lo, hi)`` of ``stripe``'s data pieces that ``out`` wants, decoded from the
  ``used`` survivors: straight into ``out`` where the range lies in the piece, else
  through a scratch block (the piece ends inside it, or nobody wants that piece)."""
  k = len(stripe.data)
  blocks: list[np.ndarray | None] = [None] * len(stripe.pieces)
  for p in used:
    blocks[p.slot] = (_zeros(hi - lo) if _is_data(stripe, p) and lo >= p.nbytes
                      else got[(p, lo, hi)])
  into: dict[int, np.ndarray] = {}
  for p in stripe.data:
    if blocks[p.slot] is None:
      whole = p.host in out and p.start + hi <= p.stop
      into[p.slot] = (out[p.host][p.start + lo:p.start + hi] if whole
                      else np.empty(hi - lo, np.uint8))
  codec_lib.codec(k, len(stripe.parity)).decode_into(blocks, into)
  for p in stripe.data:
    a, b = p.start + lo, min(p.start + hi, p.stop)
    if p.host in out and p.slot in into and a < b and b - a < hi - lo:
      out[p.host][a:b] = into[p.slot][:b - a]
