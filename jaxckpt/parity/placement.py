"""Where parity lives: groups of hosts, stripes with rotating roles (RAID-6 style).

Hosts form parity groups of up to ``group_size`` hosts. A group of g hosts has
g stripes; in stripe r the parity holders are the group's hosts r..r+m-1
(mod g) and the other k = g - m hosts contribute data. Each host's snapshot is
cut into k chunks, one for each stripe in which it is a data host, so any m
lost hosts of a group lose at most m pieces of every stripe, and each host
holds parity worth about m / (g - m) of its snapshot.

>>> layout = StripeLayout.build([384] * 4, ParityOptions(group_size=4, parity=1))
>>> [p.host for p in layout.stripes[1].parity], [p.host for p in layout.stripes[1].data]
([1], [2, 3, 0])
>>> layout.parity_bytes_per_host()
(128, 128, 128, 128)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxckpt import errors
from jaxckpt.parity import codec as codec_lib

CHUNK_ALIGN_BYTES = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityOptions:
  """Reed-Solomon parity across hosts (None in the manager's options: parity off).

  Attributes:
    group_size: Hosts per parity group (the last groups may be one smaller so
      that hosts split evenly). At most 255.
    parity: Parity pieces per stripe, m: any ``parity`` lost hosts of a group
      are rebuilt. Extra host memory is about parity / (group_size - parity)
      of the snapshot.
  """

  group_size: int = 4
  parity: int = 1

  def __post_init__(self):
    for name in ("group_size", "parity"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise errors.InvalidArgumentError(f"ParityOptions.{name} must be an int, got {name}={value!r}")
    if not 2 <= self.group_size <= codec_lib.MAX_BLOCKS:
      raise errors.InvalidArgumentError(
          f"ParityOptions.group_size must be in [2, {codec_lib.MAX_BLOCKS}], got "
          f"group_size={self.group_size}")
    if not 1 <= self.parity < self.group_size:
      raise errors.InvalidArgumentError(
          f"ParityOptions.parity must be in [1, group_size - 1] = [1, "
          f"{self.group_size - 1}], got parity={self.parity}")


@dataclasses.dataclass(frozen=True)
class Piece:
  """One block of a stripe: a data chunk of a host's snapshot or a parity block.

  Attributes:
    host: The host that holds the piece.
    stripe: Global stripe id (index into ``StripeLayout.stripes``).
    slot: Position in the codec's block list: < k data, >= k parity.
    start: Byte offset in the host's snapshot (0 for parity).
    stop: End offset (``block_bytes`` of the stripe for parity).
  """

  host: int
  stripe: int
  slot: int
  start: int
  stop: int

  @property
  def nbytes(self) -> int:
    return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Stripe:
  """k data pieces (zero-padded to ``block_bytes``) and their m parity pieces."""

  id: int
  group: int
  index: int
  block_bytes: int
  data: tuple[Piece, ...]
  parity: tuple[Piece, ...]

  @property
  def pieces(self) -> tuple[Piece, ...]:
    return self.data + self.parity


def groups(num_hosts: int, group_size: int) -> tuple[tuple[int, ...], ...]:
  """Splits hosts 0..num_hosts-1 into ceil(n / group_size) near-equal groups.

  >>> groups(6, 4)
  ((0, 1, 2), (3, 4, 5))
  """
  if num_hosts < 1 or group_size < 1:
    raise errors.InvalidArgumentError(f"need num_hosts >= 1 and group_size >= 1, got {num_hosts=} {group_size=}")
  count = -(-num_hosts // group_size)
  small, extra = divmod(num_hosts, count)
  out, start = [], 0
  for g in range(count):
    size = small + (g < extra)
    out.append(tuple(range(start, start + size)))
    start += size
  return tuple(out)


def check_hosts(num_hosts: int, options: "ParityOptions") -> None:
  """Refuses a job whose parity cannot protect anything: every group needs more
  hosts than ``options.parity`` (a lost host's parity must live on another)."""
  smallest = min(len(g) for g in groups(num_hosts, options.group_size))
  if smallest <= options.parity:
    raise errors.InvalidArgumentError(
        f"parity={options.parity} across hosts needs every parity group to have at least "
        f"{options.parity + 1} hosts, but a job of {num_hosts} host(s) split into groups of at "
        f"most group_size={options.group_size} has a group of {smallest}: run on more hosts, "
        "lower ParityOptions.parity, or turn parity off (parity=None)")


@dataclasses.dataclass(frozen=True)
class StripeLayout:
  """The parity layout for hosts with given snapshot sizes (pure, no I/O).

  Attributes:
    options: The parity options.
    host_bytes: Snapshot size of each host, in bytes.
    groups: Host ids of each parity group.
    stripes: Every stripe of every group, by global id.
  """

  options: ParityOptions
  host_bytes: tuple[int, ...]
  groups: tuple[tuple[int, ...], ...]
  stripes: tuple[Stripe, ...]

  @classmethod
  def build(cls, host_bytes: Sequence[int], options: ParityOptions) -> StripeLayout:
    """Lays out stripes for hosts 0..len(host_bytes)-1."""
    sizes = tuple(int(n) for n in host_bytes)
    if any(n < 0 for n in sizes):
      raise errors.InvalidArgumentError(f"host_bytes must be >= 0, got {sizes}")
    grouping = groups(len(sizes), options.group_size)
    too_small = [g for g in grouping if len(g) <= options.parity]
    if too_small:
      raise errors.InvalidArgumentError(
          f"{len(sizes)} hosts in groups of at most {options.group_size} give groups "
          f"{too_small} with no more hosts than parity={options.parity}; use fewer "
          "parity or more hosts")
    stripes: list[Stripe] = []
    for gid, hosts in enumerate(grouping):
      stripes.extend(_group_stripes(gid, hosts, sizes, options.parity, len(stripes)))
    return cls(options, sizes, grouping, tuple(stripes))

  def group_of(self, host: int) -> int:
    """The index of the group that holds ``host``."""
    for gid, hosts in enumerate(self.groups):
      if host in hosts:
        return gid
    raise errors.InvalidArgumentError(f"host {host} is not in the layout of {len(self.host_bytes)} hosts")

  def data_pieces(self, host: int) -> tuple[Piece, ...]:
    """The host's k snapshot chunks, in snapshot order."""
    pieces = [p for s in self.stripes for p in s.data if p.host == host]
    return tuple(sorted(pieces, key=lambda p: p.start))

  def parity_pieces(self, host: int) -> tuple[Piece, ...]:
    """The parity blocks that ``host`` holds."""
    return tuple(p for s in self.stripes for p in s.parity if p.host == host)

  def parity_bytes_per_host(self) -> tuple[int, ...]:
    """Bytes of parity each host holds."""
    return tuple(sum(p.nbytes for p in self.parity_pieces(h)) for h in range(len(self.host_bytes)))


def _group_stripes(gid: int, hosts: tuple[int, ...], sizes: tuple[int, ...], m: int,
                   first_id: int) -> list[Stripe]:
  g = len(hosts)
  k = g - m
  chunk = {h: _round_up(-(-sizes[h] // k), CHUNK_ALIGN_BYTES) for h in hosts}
  used = {h: 0 for h in hosts}  # chunks of each host handed out so far
  stripes = []
  for r in range(g):
    sid = first_id + r
    data_hosts = [hosts[(r + m + u) % g] for u in range(k)]
    data = []
    for slot, h in enumerate(data_hosts):
      start = min(sizes[h], used[h] * chunk[h])
      data.append(Piece(h, sid, slot, start, min(sizes[h], start + chunk[h])))
      used[h] += 1
    block = max(p.nbytes for p in data)
    parity = tuple(Piece(hosts[(r + t) % g], sid, k + t, 0, block) for t in range(m))
    stripes.append(Stripe(sid, gid, r, block, tuple(data), parity))
  return stripes


def _round_up(n: int, align: int) -> int:
  return -(-n // align) * align


def padded(buf: Any, nbytes: int) -> np.ndarray:
  """``buf`` as uint8, zero-padded to ``nbytes`` (no copy when already that long)."""
  arr = codec_lib.as_u8(buf, name="piece")
  if arr.size == nbytes:
    return arr
  if arr.size > nbytes:
    raise errors.InvalidArgumentError(f"piece of {arr.size} bytes is longer than its stripe's {nbytes} bytes")
  out = np.zeros(nbytes, np.uint8)
  out[:arr.size] = arr
  return out


def encode_stripe(stripe: Stripe, data: Sequence[Any]) -> list[np.ndarray]:
  """The stripe's m parity blocks from its k data pieces (in ``stripe.data`` order).

  Shorter pieces are zero-padded to ``stripe.block_bytes``.
  """
  if len(data) != len(stripe.data):
    raise errors.InvalidArgumentError(f"stripe {stripe.id} has {len(stripe.data)} data pieces, got {len(data)}")
  for piece, buf in zip(stripe.data, data):
    size = codec_lib.as_u8(buf, name="piece").size
    if size != piece.nbytes:
      raise errors.InvalidArgumentError(f"data piece {piece} is {piece.nbytes} bytes, got {size}")
  rs = codec_lib.codec(len(stripe.data), len(stripe.parity))
  return rs.encode([padded(b, stripe.block_bytes) for b in data])
