"""Simulated hosts: lose some, rebuild them from the survivors' pieces."""

from __future__ import annotations

import itertools
import logging
import re

import numpy as np
import pytest

from jaxckpt import errors
from jaxckpt.parity.placement import ParityOptions, Piece, StripeLayout, encode_stripe
from jaxckpt.parity.recovery import (check_recoverable, piece_checksums, rebuild_ranges,
                                     recover_hosts)


class Cluster:
  """Hosts holding their snapshots and the parity blocks the layout gives them."""

  def __init__(self, sizes: list[int], options: ParityOptions, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.layout = StripeLayout.build(sizes, options)
    self.snaps = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    self.parity: dict[Piece, np.ndarray] = {}
    self.checksums: dict[Piece, str] = {}
    for h, snap in enumerate(self.snaps):
      pieces = self.layout.data_pieces(h)
      self.checksums.update(piece_checksums(pieces, [snap[p.start:p.stop] for p in pieces]))
    for stripe in self.layout.stripes:
      blocks = encode_stripe(stripe, [self.snaps[p.host][p.start:p.stop] for p in stripe.data])
      self.parity.update(zip(stripe.parity, blocks))
      self.checksums.update(piece_checksums(stripe.parity, blocks))
    self.fetched: list[Piece] = []
    self.lost: set[int] = set()

  def fetch(self, piece: Piece) -> bytes:
    assert piece.host not in self.lost, f"fetched {piece} from a lost host"
    self.fetched.append(piece)
    if piece in self.parity:
      return self.parity[piece].tobytes()
    return self.snaps[piece.host][piece.start:piece.stop].tobytes()

  def recover(self, lost) -> dict[int, np.ndarray]:
    self.lost = set(lost)
    self.fetched.clear()
    return recover_hosts(self.layout, lost, self.fetch, self.checksums)


SIZES = [5000, 1234, 777, 4099]  # different, none a multiple of 8 or of k


@pytest.mark.parametrize("m", [1, 2])
def test_every_recoverable_loss_is_byte_exact(m):
  cluster = Cluster(SIZES, ParityOptions(group_size=4, parity=m))
  for count in range(1, m + 1):
    for lost in itertools.combinations(range(4), count):
      got = cluster.recover(lost)
      assert sorted(got) == list(lost)
      for h in lost:
        np.testing.assert_array_equal(got[h], cluster.snaps[h], err_msg=f"{m=} {lost=} host {h}")
      stripes = {p.stripe for p in cluster.fetched}
      assert len(cluster.fetched) == len(stripes) * (4 - m), "fetches only k pieces per stripe"


@pytest.mark.parametrize("m", [1, 2])
def test_more_lost_than_parity_names_group_and_hosts(m):
  cluster = Cluster(SIZES + SIZES, ParityOptions(group_size=4, parity=m))
  lost = [4, 5, 6][:m + 1]
  with pytest.raises(errors.UnrecoverableLossError,
                     match=rf"parity={m} .* group 1 \(hosts \[4, 5, 6, 7\]\) lost hosts "
                     + re.escape(f"{lost}; restore this step from storage")):
    cluster.recover(lost + [0])
  assert cluster.fetched == []
  with pytest.raises(RuntimeError):  # also a builtin
    check_recoverable(cluster.layout, list(range(8)))
  with pytest.raises(ValueError, match=r"lost hosts \[8\] are not in the layout of 8 hosts"):
    check_recoverable(cluster.layout, [8])


def test_losses_in_two_groups_are_rebuilt():
  cluster = Cluster(SIZES + [10, 0, 3333, 64], ParityOptions(group_size=4, parity=1), seed=3)
  got = cluster.recover([2, 5])
  np.testing.assert_array_equal(got[2], cluster.snaps[2])
  np.testing.assert_array_equal(got[5], cluster.snaps[5])
  got = cluster.recover([7])
  np.testing.assert_array_equal(got[7], cluster.snaps[7])


def test_corrupted_parity_is_detected_not_decoded():
  cluster = Cluster(SIZES, ParityOptions(group_size=4, parity=1))
  stripe = next(s for s in cluster.layout.stripes if 0 in [p.host for p in s.data])
  (piece,) = stripe.parity
  cluster.parity[piece][7] ^= 0x40
  with pytest.raises(errors.CorruptSnapshotError,
                     match=rf"stripe {stripe.id} of group 0 lost hosts \[0\] .* failed its checksum"):
    cluster.recover([0])


def test_corrupted_piece_is_left_out_when_survivors_spare(caplog):
  cluster = Cluster(SIZES, ParityOptions(group_size=4, parity=2))
  stripe = next(s for s in cluster.layout.stripes if [p.host for p in s.data].count(1) == 1)
  victim = next(p for p in stripe.data if p.host != 1)
  cluster.snaps[victim.host][victim.start] ^= 1  # a survivor's chunk rots
  with caplog.at_level(logging.WARNING, logger="jaxckpt.parity.recovery"):
    got = cluster.recover([1])
  np.testing.assert_array_equal(got[1], cluster.snaps[1])
  assert f"{victim}" in caplog.text and "failed its checksum" in caplog.text
  assert sum(p.stripe == stripe.id for p in cluster.fetched) == 3  # k + the replacement


def test_wrong_saved_checksum_of_lost_piece_is_reported():
  cluster = Cluster(SIZES, ParityOptions(group_size=4, parity=1))
  piece = cluster.layout.data_pieces(2)[0]
  cluster.checksums[piece] = "0" * 16
  with pytest.raises(errors.CorruptSnapshotError,
                     match=re.escape(f"rebuilt piece {piece} has checksum")):
    cluster.recover([2])


def test_unfetchable_survivor_is_unrecoverable():
  cluster = Cluster(SIZES, ParityOptions(group_size=4, parity=1))
  layout = cluster.layout
  with pytest.raises(errors.UnrecoverableLossError, match="could not be fetched"):
    recover_hosts(layout, [0], lambda piece: None, cluster.checksums)


def _range_fetcher(cluster: Cluster, down: set[int], asked: dict[int, int]):
  """Serves byte ranges of surviving pieces as hosts would; hosts in ``down`` cannot."""
  def fetch(host, items):
    assert host not in cluster.lost, f"asked lost host {host}"
    if host in down:
      return None
    out = []
    for p, lo, hi in items:
      if p in cluster.parity:
        out.append(cluster.parity[p][lo:hi])
      else:
        out.append(cluster.snaps[host][p.start + lo:min(p.start + hi, p.stop)])
      asked[host] = asked.get(host, 0) + out[-1].size
    return out
  return fetch


@pytest.mark.parametrize("m,lost,down,want", [(1, (1,), (), (1,)), (1, (3,), (), (3,)),
                                              (2, (0, 2), (), (0, 2)), (2, (0, 2), (), (2,)),
                                              (2, (1,), (2,), (1,))])
def test_rebuilt_ranges_are_byte_exact_and_read_only_their_stripes_ranges(m, lost, down, want):
  # A restore onto another mesh needs a few shards of a lost host: only their ranges are
  # rebuilt, from k survivors' same ranges (a host that cannot serve has a stand-in).
  cluster = Cluster(SIZES, ParityOptions(group_size=4, parity=m))
  cluster.lost = set(lost)
  wanted = {h: [(10, 300), (250, 700), (SIZES[h] - 90, SIZES[h])] for h in want}
  out = {h: np.zeros(SIZES[h], np.uint8) for h in want}
  asked: dict[int, int] = {}
  fetched = rebuild_ranges(cluster.layout, lost, wanted,
                           _range_fetcher(cluster, set(down), asked), out)
  for h in want:
    mask = np.zeros(SIZES[h], bool)
    for a, b in wanted[h]:
      mask[a:b] = True
    np.testing.assert_array_equal(out[h][mask], cluster.snaps[h][mask], err_msg=f"host {h}")
    assert not out[h][~mask].any(), "rebuilt bytes nobody asked for"
  merged = [(10, 700), (-90, 0)]             # what each lost host needs, overlaps joined
  assert fetched == sum(asked.values())
  assert fetched <= (4 - m) * sum(b - a for _ in want for a, b in merged)
  assert fetched < sum(SIZES) / 2, "a whole-host rebuild reads every survivor's snapshot"


def test_rebuilt_ranges_say_which_stripe_has_too_few_survivors():
  cluster = Cluster(SIZES, ParityOptions(group_size=4, parity=1))
  cluster.lost = {1}
  with pytest.raises(errors.UnrecoverableLossError, match=r"stripe \d of group 0 lost hosts "
                     r"\[1\], and hosts \[2\] could not serve"):
    rebuild_ranges(cluster.layout, [1], {1: [(0, 100)]}, _range_fetcher(cluster, {2}, {}),
                   {1: np.zeros(SIZES[1], np.uint8)})
