"""The JSON jaxckpt writes to storage (manifests, part records): one dialect, written
here.

JSON has no NaN or infinity, and a loss that goes NaN is exactly when a user needs the
steps before it. jaxckpt writes a non-finite float as Python's ``json`` and orbax's
metrics files do (``NaN``, ``Infinity``, ``-Infinity``), so every document written since
format v1 reads the same, and a step's metrics come back exactly. msgspec (fast, typed,
what a large manifest needs) reads and writes strict JSON only: it refuses those tokens
and writes a non-finite float as ``null`` (a NaN loss would come back as None). So
msgspec is the path for a document without one and ``json`` the path for one with one:
:func:`encode` chooses, for every document jaxckpt writes to storage; a reader takes
msgspec's typed decoder and, where it refuses the document, ``json``'s (the part records'
:func:`jaxckpt.universal._merge.decode`; a manifest is read by ``json``).

>>> encode({"loss": float("nan"), "a": [1, -float("inf")]})
b'{"a":[1,-Infinity],"loss":NaN}'
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec


def finite(obj: Any) -> bool:
  """Whether ``obj`` (a JSON-like value) holds no non-finite float."""
  if isinstance(obj, float):
    return math.isfinite(obj)
  if isinstance(obj, dict):
    return all(finite(v) for v in obj.values())
  if isinstance(obj, (list, tuple)):
    return all(finite(v) for v in obj)
  return True


def encode(obj: Any, *, floats: Any = None) -> bytes:
  """``obj`` as compact JSON, its keys sorted, a non-finite float as ``NaN``,
  ``Infinity`` or ``-Infinity``. ``floats``: the parts of ``obj`` that may hold a
  float (None: all of it; a manifest's chunk tables hold none, and walking them would
  cost more than encoding them)."""
  if finite(obj if floats is None else floats):
    try:
      return msgspec.json.encode(obj, order="sorted")
    except (OverflowError, TypeError):   # (an int past 64 bits, a tuple key: json's way)
      pass
  return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
