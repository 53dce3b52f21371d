"""Reading a step's orbax items back as the user saved them, for tools.

A step saved with ``args=ocp.args.Composite(...)`` records the kind of each
item in its metadata (``{"jaxckpt.items": {name: kind}}``, kinds ``pytree``,
``json`` and ``grain``). A pytree item is the leaves under ``['name']``; a JSON
item is the leaf ``['name']`` holding its JSON text (one value for the whole
job; older steps: rows as a Grain state); a Grain iterator's state is the leaf
``['name']``, a ``(process_count, ROW_BYTES)`` uint8 array with one row per
saving process: an 8-byte little-endian length, then that many bytes of UTF-8
JSON, then zeros. (The writer is ``jaxckpt``'s orbax layer, which encodes a row with
:func:`encode_row`, as does the reading of an orbax step's Grain item.)

>>> row = np.zeros(32, np.uint8); row[:8] = [7, 0, 0, 0, 0, 0, 0, 0]
>>> row[8:15] = np.frombuffer(b'{"a":1}', np.uint8)
>>> decode_rows(row[None], "meta")
[{'a': 1}]
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from jaxckpt import errors

ITEMS_KEY = "jaxckpt.items"       # {name: kind} of a Composite step
ITEM_KEY = "jaxckpt.item"         # the kind of a single item saved through args= (not a pytree)
TIME_KEY = "jaxckpt.time"          # a manager's record of the step's save time (epoch seconds)
METRICS_KEY = "jaxckpt.metrics"    # save(metrics=...)
OWN_PREFIX = "jaxckpt."            # jaxckpt's records; the rest is the user's metadata
PYTREE, JSON, GRAIN = "pytree", "json", "grain"
ROW_BYTES = 1 << 16               # a Grain iterator's state is a few hundred bytes of JSON
_LEN_BYTES = 8


def kinds(metadata: Mapping[str, Any] | None) -> dict[str, str]:
  """The step's items by name (``{}`` for a step saved as one plain tree)."""
  got = (metadata or {}).get(ITEMS_KEY)
  return dict(got) if isinstance(got, Mapping) else {}


def path_of(name: str) -> str:
  """The tree path of item ``name`` (of its leaf, for a JSON or Grain item)."""
  return f"[{name!r}]"


def is_row_leaf(info: Any) -> bool:
  """Whether a leaf (a LeafInfo) has the shape a JSON or Grain item is stored in."""
  return info.is_array and info.dtype == "uint8" and len(info.shape) == 2 and info.shape[1] > 8


def is_json_leaf(info: Any) -> bool:
  """Whether a leaf holds a JSON item as its text (one value for the whole job)."""
  return not info.is_array and isinstance(info.scalar, str)


def decode_json(text: str, name: str) -> Any:
  """A JSON item's value from its text; CorruptSnapshotError naming the item if damaged."""
  try:
    return json.loads(text)
  except ValueError as e:
    raise errors.CorruptSnapshotError(f"item {name!r}: not JSON ({e})") from None


def encode_row(data: bytes, name: str) -> np.ndarray:
  """``data`` as one row of a data iterator's item: an 8-byte length, then the bytes."""
  if len(data) > ROW_BYTES - _LEN_BYTES:
    raise errors.InvalidArgumentError(
        f"item {name!r}: the data iterator's state is {len(data)} bytes, over the "
        f"{ROW_BYTES - _LEN_BYTES} it holds")
  row = np.zeros(ROW_BYTES, np.uint8)
  row[:_LEN_BYTES] = np.frombuffer(len(data).to_bytes(_LEN_BYTES, "little"), np.uint8)
  row[_LEN_BYTES:_LEN_BYTES + len(data)] = np.frombuffer(data, np.uint8)
  return row


def decode_rows(rows: np.ndarray, name: str) -> list[Any]:
  """Each saving process's value of a JSON or Grain item, from its uint8 rows.

  Raises:
    CorruptSnapshotError: a row's length or JSON is damaged (naming the item and the row).
  """
  out = []
  for i, row in enumerate(np.asarray(rows, np.uint8).reshape(len(rows), -1)):
    n = int.from_bytes(row[:_LEN_BYTES].tobytes(), "little")
    if n > row.size - _LEN_BYTES:
      raise errors.CorruptSnapshotError(
          f"item {name!r}, row {i}: it claims {n} bytes in a row of {row.size - _LEN_BYTES}")
    try:
      out.append(json.loads(row[_LEN_BYTES:_LEN_BYTES + n].tobytes().decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:
      raise errors.CorruptSnapshotError(f"item {name!r}, row {i}: not UTF-8 JSON ({e})") from None
  return out


def grain_fields(value: Any) -> dict[str, Any]:
  """A Grain iterator's state as its fields: a DataLoader's state is JSON text (bytes when
  saved), a dataset iterator's a dict; both decode to a dict."""
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except ValueError:
      return {"state": value}
  return value if isinstance(value, dict) else {"state": value}


def surviving(metadata: Mapping[str, Any], leaves: Mapping[str, Any],
              origins: Mapping[str, str | None]) -> dict[str, str] | None:
  """The item records that stay true after a conversion: a pytree item with a leaf left
  under its path; a JSON or Grain item whose leaf is still there, unchanged (renamed to a
  top-level path: recorded under its new name). None if the step recorded no items.

  Args:
    metadata: the source step's. leaves: the converted tree (path -> LeafInfo).
    origins: converted path -> the source path it is a plain copy of (None if computed).
  """
  saved = kinds(metadata)
  if ITEMS_KEY not in (metadata or {}):
    return None
  out = {}
  for name, kind in saved.items():
    if kind == PYTREE:
      for path, origin in origins.items():
        if path.startswith(path_of(name)):
          out[name] = kind
        elif origin is not None and origin.startswith(path_of(name)):
          moved = _top_level_name(_first_key(path))
          if moved is not None:
            out[moved] = kind
      continue
    for path, origin in origins.items():
      if origin == path_of(name) and (is_row_leaf(leaves[path]) or is_json_leaf(leaves[path])):
        new = _top_level_name(path)
        if new is not None:
          out[new] = kind
  return out


def _first_key(path: str) -> str:
  """``"['a']['b']"`` -> ``"['a']"`` (the path itself if it has one key)."""
  end = path.find("]")
  return path[:end + 1] if end >= 0 else path


def _top_level_name(path: str) -> str | None:
  """``"['data']"`` -> ``'data'``; None for a deeper or odd path."""
  if path.startswith("['") and path.endswith("']") and path.count("['") == 1:
    return path[2:-2]
  return None
