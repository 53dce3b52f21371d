"""Damage a committed step on storage on purpose (tests, the chaos soak): one
byte of one stored element flipped, as a failing disk or a bad write would; or
its manifest rewritten and resealed (to claim an impossible leaf, say), as a
writer holding the storage's credentials (or another jaxckpt version) would. On
a local directory or any kvstore URL (``s3://`` too)."""

from __future__ import annotations

import json
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


def _committed(directory: str, step: int) -> tuple[Any, str, str, dict[str, Any], dict[str, Any]]:
  """Committed ``step``'s store, marker key, manifest key, marker and manifest (a local
  directory or any kvstore URL: ``s3://`` too)."""
  kv = lay.open_kvstore(directory)
  key = lay.commit_key(step)
  marker = json.loads(kv.read(key).result(timeout=lay.REQUEST_TIMEOUT_SECS).value)
  path = lay.manifest_key(step, marker.get("attempt"))
  body = kv.read(path).result(timeout=lay.REQUEST_TIMEOUT_SECS).value
  return kv, key, path, marker, json.loads(body)


def stored_manifest(directory: str, step: int) -> dict[str, Any]:
  """Committed ``step``'s manifest, as JSON."""
  return _committed(directory, step)[4]


def reseal_manifest(directory: str, step: int,
                    edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
  """Rewrites committed ``step``'s manifest and commit marker as ``edit(manifest,
  marker)`` leaves them (JSON, edited in place), the marker carrying the new
  manifest's checksum: only what the manifest says can refuse it."""
  kv, key, path, marker, doc = _committed(directory, step)
  edit(doc, marker)
  body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
  kv.write(path, body).result(timeout=lay.REQUEST_TIMEOUT_SECS)
  marker["manifest_xxh3"] = snap.checksum(body)
  kv.write(key, json.dumps(marker).encode()).result(timeout=lay.REQUEST_TIMEOUT_SECS)


def nest_manifest(directory: str, step: int, depth: int) -> None:
  """Reseals committed ``step`` so that its metadata holds a list nested ``depth`` levels
  deep (``[[[...]]]``: valid JSON, its checksum in the marker), as no encoder of Python
  writes it past ~1,000 levels: only a reader that refuses it keeps restores going."""
  kv, key, path, marker, doc = _committed(directory, step)
  doc.setdefault("metadata", {})["nested"] = "@nested@"
  body = json.dumps(doc, separators=(",", ":"), sort_keys=True).replace(
      '"@nested@"', "[" * depth + "]" * depth).encode()
  kv.write(path, body).result(timeout=lay.REQUEST_TIMEOUT_SECS)
  marker["manifest_xxh3"] = snap.checksum(body)
  kv.write(key, json.dumps(marker).encode()).result(timeout=lay.REQUEST_TIMEOUT_SECS)


def claim_impossible_leaf(directory: str, step: int, leaf: str) -> None:
  """Reseals committed ``step`` so that ``leaf`` claims 2^40 x 2^40 elements in one chunk
  (its shape, layout and checksum table consistent with that): a manifest no restore
  can size anything by, which must be damage like any other."""
  def edit(doc: dict[str, Any], marker: dict[str, Any]) -> None:
    del marker
    rec, = [r for r in doc["leaves"] if r["path"] == leaf]
    rank = max(1, len(rec["shape"]))
    rec["shape"] = rec["chunk_shape"] = rec["inner_chunk_shape"] = [2**40] * rank
    rec["chunks"] = {".".join(["0"] * rank): next(iter(rec["chunks"].values()))}
  reseal_manifest(directory, step, edit)
