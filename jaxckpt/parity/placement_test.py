"""Tests of parity options, host groups and the rotating stripe layout."""

from __future__ import annotations

import numpy as np
import pytest

from jaxckpt.parity import codec
from jaxckpt.parity.placement import (ParityOptions, StripeLayout, encode_stripe, groups,
                                      padded)


@pytest.mark.parametrize("kwargs,match", [
    ({"group_size": 1}, "group_size must be in \\[2, 255\\], got group_size=1"),
    ({"group_size": 256}, "group_size=256"),
    ({"parity": 0}, "parity must be in \\[1, group_size - 1\\] = \\[1, 3\\], got parity=0"),
    ({"group_size": 3, "parity": 3}, "got parity=3"),
    ({"parity": True}, "parity must be an int, got parity=True"),
    ({"group_size": 4.0}, "group_size must be an int"),
])
def test_options_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ParityOptions(**kwargs)


def test_options_frozen_keyword_only():
  opts = ParityOptions(group_size=6, parity=2)
  with pytest.raises(AttributeError):
    opts.parity = 1  # type: ignore[misc]
  with pytest.raises(TypeError):
    ParityOptions(4, 1)  # type: ignore[misc]


def test_groups_split_evenly():
  assert groups(8, 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert groups(6, 4) == ((0, 1, 2), (3, 4, 5))
  assert groups(9, 4) == ((0, 1, 2), (3, 4, 5), (6, 7, 8))
  assert groups(3, 8) == ((0, 1, 2),)
  with pytest.raises(ValueError, match="num_hosts=0"):
    groups(0, 4)


@pytest.mark.parametrize("g,m", [(4, 1), (4, 2), (5, 2), (6, 3)])
def test_roles_rotate_and_chunks_tile_each_snapshot(g, m):
  sizes = [1000 + 77 * h for h in range(g)]
  layout = StripeLayout.build(sizes, ParityOptions(group_size=g, parity=m))
  assert len(layout.stripes) == g
  for r, stripe in enumerate(layout.stripes):
    assert [p.host for p in stripe.parity] == [(r + t) % g for t in range(m)]
    assert [p.host for p in stripe.data] == [(r + m + u) % g for u in range(g - m)]
    assert [p.slot for p in stripe.pieces] == list(range(g))
    assert stripe.block_bytes == max(p.nbytes for p in stripe.data)
  for h in range(g):
    chunks = layout.data_pieces(h)
    assert len(chunks) == g - m
    assert [(c.start, c.stop) for c in chunks][0][0] == 0
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1].stop == sizes[h]
    assert len(layout.parity_pieces(h)) == m


def test_parity_memory_is_m_over_k_of_snapshot():
  size = 64 * 3 * 1000
  for m in (1, 2):
    layout = StripeLayout.build([size] * 8, ParityOptions(group_size=4, parity=m))
    assert layout.parity_bytes_per_host() == (size * m // (4 - m),) * 8


def test_multiple_groups_and_too_small_group():
  layout = StripeLayout.build([500] * 6, ParityOptions(group_size=4, parity=1))
  assert layout.groups == ((0, 1, 2), (3, 4, 5))
  assert {p.host for s in layout.stripes if s.group == 1 for p in s.pieces} == {3, 4, 5}
  assert layout.group_of(4) == 1
  with pytest.raises(ValueError, match=r"groups \[\(3, 4\)\] with no more hosts than parity=2"):
    StripeLayout.build([500] * 5, ParityOptions(group_size=4, parity=2))
  with pytest.raises(ValueError, match="host 9 is not in the layout of 6 hosts"):
    layout.group_of(9)


def test_encode_stripe_pads_short_pieces():
  layout = StripeLayout.build([300, 40, 0], ParityOptions(group_size=3, parity=1))
  snaps = [np.random.default_rng(h).integers(0, 256, n, dtype=np.uint8)
           for h, n in enumerate(layout.host_bytes)]
  for stripe in layout.stripes:
    data = [snaps[p.host][p.start:p.stop] for p in stripe.data]
    (parity,) = encode_stripe(stripe, data)
    want = np.zeros(stripe.block_bytes, np.uint8)
    for d in data:
      want[:d.size] ^= d
    np.testing.assert_array_equal(parity, want)
  with pytest.raises(ValueError, match="has 2 data pieces, got 1"):
    encode_stripe(layout.stripes[0], [b""])
  assert padded(b"ab", 4).tolist() == [97, 98, 0, 0]
  assert codec.as_u8(b"ab").size == 2


def test_parity_modules_import_nothing_heavy():
  """jaxckpt.parity may import only numpy/numba/llvmlite, the stdlib, errors and checksum."""
  import ast
  import pathlib
  import sys
  allowed = {"numpy", "numba", "llvmlite", "jaxckpt"} | set(sys.stdlib_module_names)
  for path in pathlib.Path(__file__).parent.glob("*.py"):
    if path.name.endswith("_test.py"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
        if node.module == "jaxckpt":
          names = [f"jaxckpt.{a.name}" for a in node.names]
        if node.module == "jaxckpt.host.snapshot":
          assert [a.name for a in node.names] == ["checksum"], path.name
      else:
        continue
      for name in names:
        assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
        if name.startswith("jaxckpt"):
          assert name.startswith(("jaxckpt.errors", "jaxckpt.host.snapshot", "jaxckpt.parity")), (
              f"{path.name} imports {name}")
