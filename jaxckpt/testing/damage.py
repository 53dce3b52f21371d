"""Damage a committed step on storage on purpose (tests, the chaos soak): one
byte of one stored element flipped, as a failing disk or a bad write would."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorstore as ts

from jaxckpt.universal import _arrays, _read
from jaxckpt.universal import _layout as lay


def flip_stored_byte(directory: str, step: int, leaf: str, index: Sequence[int]) -> None:
  """Flips the first byte of element ``index`` of ``leaf`` (a tree path, e.g.
  ``"['w']"``) of committed ``step``. The chunk stays readable (its storage
  checksums are rewritten with it), so only the manifest's checksum of the
  chunk finds the damage: a restore reading it raises CorruptSnapshotError."""
  info = _read.open_step(directory, step).leaves[leaf]
  spec = _arrays.open_for_read(directory, step, info).spec()
  store = ts.open(spec, open=True, read=True, write=True, context=lay.context()).result(
      timeout=lay.REQUEST_TIMEOUT_SECS)
  where = tuple(slice(i, i + 1) for i in index)
  value = np.array(store[where].read().result(timeout=lay.REQUEST_TIMEOUT_SECS))
  value.reshape(-1).view(np.uint8)[0] ^= 0xFF
  store[where].write(value).result(timeout=lay.REQUEST_TIMEOUT_SECS)
