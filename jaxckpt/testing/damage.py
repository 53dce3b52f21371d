"""Damage a committed step on storage on purpose (tests, the chaos soak): one
byte of one stored element flipped, as a failing disk or a bad write would; or
its manifest rewritten and resealed, as a writer holding the storage's
credentials (or another jaxckpt version) would."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from jaxckpt.host import snapshot as snap
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


def _committed(directory: str, step: int) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
  """Committed ``step``'s commit marker path, manifest path, marker and manifest."""
  key = os.path.join(directory, lay.commit_key(step))
  with open(key) as f:
    marker = json.load(f)
  path = os.path.join(directory, lay.manifest_key(step, marker.get("attempt")))
  with open(path) as f:
    return key, path, marker, json.load(f)


def stored_manifest(directory: str, step: int) -> dict[str, Any]:
  """Committed ``step``'s manifest, as JSON."""
  return _committed(directory, step)[3]


def reseal_manifest(directory: str, step: int,
                    edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
  """Rewrites committed ``step``'s manifest and commit marker as ``edit(manifest,
  marker)`` leaves them (JSON, edited in place), the marker carrying the new
  manifest's checksum: only what the manifest says can refuse it."""
  key, path, marker, doc = _committed(directory, step)
  edit(doc, marker)
  body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
  with open(path, "wb") as f:
    f.write(body)
  marker["manifest_xxh3"] = snap.checksum(body)
  with open(key, "w") as f:
    json.dump(marker, f)
