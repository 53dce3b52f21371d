"""Pytree <-> leaves: paths, kinds, and matching a restore target to a snapshot.

A state is any pytree that JAX can flatten (dict, list, tuple, namedtuple,
dataclass pytrees, ``nnx.State``, ``eqx.Module``, optax states; ``None`` is an
empty subtree). Its leaves are ``jax.Array`` (typed PRNG keys included), numpy
arrays and scalars, and Python ``bool``/``int``/``float``/``complex``/``str``/``bytes``.

A callable held as an attribute of a pytree object (an ``eqx.Module``'s
``activation``, an ``eqx.nn.Lambda``'s function) is part of the object's
definition, as a static field is: it is not saved, and a restore takes it from
the target. A callable anywhere else (a dict entry, a list item) is refused.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import functools
import re
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxckpt import errors
from jaxckpt.host.snapshot import LeafRecord, dtype_from_name

PyTree = Any
_SCALAR_TYPES = (bool, int, float, complex, str, bytes)


class Leaf(NamedTuple):
  """One flattened leaf: its path, kind and (for arrays) the array to store.

  A named tuple: ``save()`` builds one per leaf on every call (~0.3 us, a
  frozen dataclass ~1.5 us).
  """

  path: str
  kind: str                     # "jax" | "numpy" | "prng_key" | "scalar"
  value: Any                    # the array (key data for prng_key) or scalar
  key_impl: str | None = None


def is_prng_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None or isinstance(dtype, np.dtype):   # numpy/ml_dtypes: never a key (fast)
    return False
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def flatten(state: PyTree) -> tuple[list[Leaf], Any]:
  """Flattens ``state`` into classified leaves and its treedef.

  Raises:
    UnsupportedLeafError: for a leaf of a type jaxckpt cannot snapshot.
  """
  leaves, treedef = jax.tree_util.tree_flatten(state)
  paths = _PATHS.get(treedef)
  if paths is None:            # building path strings is the slow part: once per structure
    if len(_PATHS) > 16:
      _PATHS.pop(next(iter(_PATHS)))
    paths = _PATHS[treedef] = [jax.tree_util.keystr(p) for p, _ in
                               jax.tree_util.tree_flatten_with_path(state)[0]]
  # _classify gives None for a static callable: not saved
  return [leaf for leaf in map(_classify, paths, leaves) if leaf is not None], treedef


_PATHS: dict[Any, list[str]] = {}
try:    # the concrete jax.Array class: an exact type check is ~10x cheaper than isinstance
  from jax._src.array import ArrayImpl as _ARRAY_IMPL  # pylint: disable=g-import-not-at-top
except ImportError:  # pragma: no cover  (a jax without it: every leaf is classified)
  _ARRAY_IMPL = None


def _classify(path: str, x: Any) -> Leaf | None:
  """``x`` as a Leaf, or None for a static callable (see the module docstring)."""
  if type(x) is _ARRAY_IMPL and isinstance(x.dtype, np.dtype):   # the common case, first
    return Leaf(path, "jax", x)
  if isinstance(x, jax.Array):
    if is_prng_key(x):
      return Leaf(path, "prng_key", jax.random.key_data(x),
                  str(jax.random.key_impl(x)))
    return Leaf(path, "jax", x)
  if isinstance(x, (np.ndarray, np.generic)):
    _check_restorable(path, x.dtype)
    return Leaf(path, "numpy", np.asarray(x))
  if isinstance(x, _SCALAR_TYPES):
    return Leaf(path, "scalar", x)
  if callable(x) and _ATTRIBUTE.search(path):
    return None
  raise errors.UnsupportedLeafError(
      f"leaf {path} has type {type(x).__module__}.{type(x).__qualname__}, which "
      "jaxckpt cannot snapshot; leaves must be jax.Array, numpy arrays, or "
      "bool/int/float/complex/str/bytes (a callable only as an attribute of a pytree "
      "object, e.g. an eqx.Module field, which a restore takes from its target). "
      "Convert it, or register its class as a pytree node "
      "(jax.tree_util.register_dataclass) so its fields are leaves")


_ATTRIBUTE = re.compile(r"\.[A-Za-z_]\w*$")     # a keystr path whose last key is an attribute


class _Static:
  """A target's static callable, kept in the treedef (no children) and given back by unflatten."""

  __slots__ = ("value",)

  def __init__(self, value: Any) -> None:
    self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: value)


def _is_static(key_path: tuple[Any, ...], x: Any) -> bool:
  return (callable(x) and bool(key_path)
          and isinstance(key_path[-1], jax.tree_util.GetAttrKey))


def _flatten_target(target: PyTree) -> tuple[list[tuple[Any, Any]], Any]:
  """The target's leaves with their key paths, static callables moved into the treedef
  (so unflattening puts the target's own callables back)."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(target)
  if not any(_is_static(p, x) for p, x in with_paths):
    return with_paths, treedef
  marked = treedef.unflatten([_Static(x) if _is_static(p, x) else x for p, x in with_paths])
  return jax.tree_util.tree_flatten_with_path(marked)


@functools.lru_cache(maxsize=256)
def _restorable(dtype: np.dtype) -> bool:
  """Whether every tier can store ``dtype`` and give it back by name, bit-exact."""
  if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
    return False
  if dtype.kind in "OSUa":
    return False
  if dtype.kind == "V" and not dtype.type.__module__.startswith("ml_dtypes"):
    return False          # raw void bytes (ml_dtypes' bfloat16 & co are kind "V" too)
  try:
    return dtype_from_name(dtype.name) == dtype
  except errors.ManifestError:
    return False


def _check_restorable(path: str, dtype: np.dtype) -> None:
  if not _restorable(dtype):
    raise errors.UnsupportedLeafError(
        f"leaf {path} is a numpy array of dtype={dtype.name} ({dtype.str}), which jaxckpt "
        "cannot restore (object, string, bytes and structured arrays are refused before "
        "anything is saved); store numeric arrays, or plain Python str/bytes scalars")


def scalar_to_json(x: Any) -> dict[str, Any]:
  """JSON form of a Python scalar leaf, keeping its exact type."""
  if isinstance(x, bool):
    return {"type": "bool", "v": x}
  if isinstance(x, int):
    return {"type": "int", "v": str(x)}   # str: ints may exceed JSON's range
  if isinstance(x, float):
    return {"type": "float", "v": x.hex()}
  if isinstance(x, complex):
    return {"type": "complex", "v": [x.real.hex(), x.imag.hex()]}
  if isinstance(x, str):
    return {"type": "str", "v": x}
  return {"type": "bytes", "v": base64.b64encode(x).decode("ascii")}


def scalar_from_json(o: Any) -> Any:
  """A scalar leaf's value from :func:`scalar_to_json`'s form; a plain JSON value
  (a step imported from another format) is returned as it is."""
  if not (isinstance(o, dict) and set(o) == {"type", "v"}):
    return o
  t, v = o["type"], o["v"]
  if t == "bool":
    return bool(v)
  if t == "int":
    return int(v)
  if t == "float":
    return float.fromhex(v)
  if t == "complex":
    return complex(float.fromhex(v[0]), float.fromhex(v[1]))
  if t == "str":
    return v
  return base64.b64decode(v)


@dataclasses.dataclass(frozen=True, slots=True)
class TargetLeaf:
  """What the caller wants back for one leaf."""

  path: str
  mode: str                   # "jax" | "numpy" | "scalar"
  shape: tuple[int, ...] = ()
  dtype: Any = None
  sharding: jax.sharding.Sharding | None = None   # None: uncommitted, default device
  numpy_scalar: bool = False
  key_data: bool = False      # a PRNG key's target given as its key data: sharding is the data's


class FlatTarget(dict):
  """A restore target given leaf by leaf: ``{saved path: target leaf}``, any subset of
  the saved leaves with ``partial``; the restore returns ``{saved path: value}``.
  A target leaf is what a tree's leaf would be (``None`` for a scalar)."""


def check_metadata(metadata: Any) -> None:
  """Raises InvalidArgumentError unless ``metadata`` (a ``save()``'s) is a dict JSON
  stores as it is, naming the first value it cannot (a snapshot records it as JSON).

  >>> check_metadata({"lr": 0.1, "sched": [1, 2], "name": None})
  >>> check_metadata({"loss": np.float32(1)})
  Traceback (most recent call last):
  ...
  jaxckpt.errors.InvalidArgumentError: save(metadata=...): metadata['loss'] is a numpy.float32 (1.0), which JSON cannot store; pass plain Python values (float(x), int(x), str(x), and lists and dicts of them)
  """
  if metadata is None:
    return
  if not isinstance(metadata, dict):
    raise errors.InvalidArgumentError(
        f"save(metadata={type(metadata).__name__}): metadata is a dict of JSON values "
        "(str keys; str, int, float, bool, None, and lists and dicts of them)")
  _check_json("metadata", metadata, set())


def _check_json(where: str, x: Any, above: set[int]) -> None:
  if isinstance(x, (dict, list, tuple)):
    if id(x) in above:
      raise errors.InvalidArgumentError(
          f"save(metadata=...): {where} is a container it lies in (a cycle); JSON stores "
          "a tree: pass a copy without the cycle")
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
      if isinstance(x, dict) and not isinstance(k, str):
        raise errors.InvalidArgumentError(
            f"save(metadata=...): {where} has the key {k!r}, a {type(k).__name__}; JSON "
            "keys are str (a number key would come back as a str): use str keys")
      _check_json(f"{where}[{k!r}]", v, above | {id(x)})
  elif x is not None and not isinstance(x, (str, int, float)):   # (bool is an int)
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    raise errors.InvalidArgumentError(
        f"save(metadata=...): {where} is a {kind} ({str(x)[:40]}), which JSON cannot "
        "store; pass plain Python values (float(x), int(x), str(x), and lists and dicts "
        "of them)")


def match_target(target: PyTree, saved: tuple[LeafRecord, ...], step: int, *,
                 partial: bool = False) -> tuple[list[TargetLeaf], Any, list[int]]:
  """Checks ``target`` against the saved leaves; returns per-leaf targets, the
  target's treedef, and the index of each target leaf among the saved ones.

  Everything is checked before anything is restored, and the first
  mismatching path is named. With ``partial`` the target may hold any subset
  of the saved leaves (each one it holds must have been saved).
  """
  if isinstance(target, FlatTarget):
    paths, leaves, treedef = list(target), list(target.values()), None
  else:
    with_paths, treedef = _flatten_target(target)
    paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
    leaves = [x for _, x in with_paths]
  saved_paths = [leaf.path for leaf in saved]
  if partial:
    where = {p: i for i, p in enumerate(saved_paths)}
    missing = [p for p in paths if p not in where]
    if missing:
      raise errors.StructureMismatchError(
          f"partial restore: target leaf {missing[0]} was not saved in step {step} (saved: "
          f"{saved_paths[:8]}{' ...' if len(saved_paths) > 8 else ''}); fix the target's paths")
    index = [where[p] for p in paths]
  elif paths != saved_paths:
    raise errors.StructureMismatchError(_structure_message(paths, saved_paths, step))
  else:
    index = list(range(len(saved)))
  out = [_target_leaf(p, x, saved[i], step) for (p, x), i in zip(zip(paths, leaves), index)]
  return out, treedef, index


def _structure_message(paths: list[str], saved: list[str], step: int) -> str:
  for i, (a, b) in enumerate(zip(paths, saved)):
    if a != b:
      return (f"restore target does not match the tree saved at step {step}: "
              f"leaf #{i} is {a} in the target but {b} in the snapshot; pass a "
              "target built the same way as the saved state")
  if len(paths) < len(saved):
    return (f"restore target does not match the tree saved at step {step}: the "
            f"target lacks {saved[len(paths)]} (it has {len(paths)} leaves, the "
            f"snapshot {len(saved)})")
  return (f"restore target does not match the tree saved at step {step}: the "
          f"target has {paths[len(saved)]} which was not saved (it has "
          f"{len(paths)} leaves, the snapshot {len(saved)})")


def _target_leaf(path: str, x: Any, rec: LeafRecord, step: int) -> TargetLeaf:
  if rec.kind == "scalar":
    if not isinstance(x, _SCALAR_TYPES) and x is not None:
      raise _mismatch(path, step, f"a {type(x).__name__}", "a Python scalar")
    return TargetLeaf(path, "scalar")
  if isinstance(x, _SCALAR_TYPES):
    raise _mismatch(path, step, f"a Python {type(x).__name__}",
                    f"an array of shape {rec.shape}")
  shape = tuple(getattr(x, "shape", ()))
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    raise errors.StructureMismatchError(
        f"restore target leaf {path} is a {type(x).__name__}; use a "
        "jax.ShapeDtypeStruct, a jax.Array or a numpy array")
  saved_shape = rec.shape[:-1] if rec.kind == "prng_key" else rec.shape
  if (rec.kind == "prng_key" and not is_prng_key(x) and shape == tuple(rec.shape)
      and np.dtype(dtype) == rec.numpy_dtype):
    # the key's data (orbax's to_shape_dtype_struct of a typed key): a typed key comes back
    key_data = _target_leaf(path, x, rec._replace(kind="jax"), step)
    return dataclasses.replace(key_data, shape=saved_shape, key_data=True)
  if shape != saved_shape:
    raise _mismatch(path, step, f"shape {shape}", f"shape {saved_shape}")
  if rec.kind == "prng_key":
    if not is_prng_key(x):
      raise _mismatch(path, step, f"dtype {dtype}", f"a PRNG key ({rec.key_impl})")
    impl = _key_impl_name(x)
    if rec.key_impl is not None and impl is not None and impl != rec.key_impl:
      raise _mismatch(path, step, f"a {impl!r} PRNG key",
                      f"a {rec.key_impl!r} PRNG key (a key's bits mean nothing to another "
                      "implementation)")
    dtype = np.dtype(rec.dtype)
  elif is_prng_key(x) or np.dtype(dtype) != rec.numpy_dtype:
    raise _mismatch(path, step, f"dtype {dtype}", f"dtype {rec.dtype}")
  if isinstance(x, (np.ndarray, np.generic)):
    return TargetLeaf(path, "numpy", shape, dtype, numpy_scalar=isinstance(x, np.generic))
  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.Array) and not getattr(x, "_committed", True):
    sharding = None      # an uncommitted array: restore it uncommitted too
  return TargetLeaf(path, "jax", shape, dtype, sharding)


def _key_impl_name(x: Any) -> str | None:
  """The PRNG implementation of a key array or of a key's ShapeDtypeStruct."""
  if isinstance(x, jax.Array):
    return str(jax.random.key_impl(x))
  impl = getattr(getattr(x, "dtype", None), "_impl", None)   # ShapeDtypeStruct: no public way
  return None if impl is None else str(getattr(impl, "name", impl))


def _mismatch(path: str, step: int, got: str, want: str) -> errors.StructureMismatchError:
  return errors.StructureMismatchError(
      f"restore target leaf {path} has {got} but step {step} saved {want}; fix "
      "the target (or restore with target=None to get what was saved)")


_KEY = re.compile(r"""\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|-?\d+)\]|\.([A-Za-z_]\w*)"""
                  r"|\[<flat index (\d+)>\]")   # the last: jax's FlattenedIndexKey (eqx.nn.State)


def path_keys(path: str) -> list[str | int]:
  """The keys of a ``keystr`` path: ``"['a'][0].b"`` -> ``['a', 0, 'b']``.

  A flattened index (``[<flat index 0>]``, from a ``FlattenedIndexKey``) is an int.
  """
  keys, pos = [], 0
  for m in _KEY.finditer(path):
    if m.start() != pos:
      break
    text, attr, flat = m.groups()
    keys.append(attr if attr is not None else int(flat) if flat is not None else
                int(text) if text[0] not in "'\"" else ast.literal_eval(text))
    pos = m.end()
  if pos != len(path) or not keys:
    raise errors.ConversionError(
        f"leaf path {path!r} is not a jax keystr path ([\'key\'], [index], .attr) "
        f"from character {pos}; Rename it with a conversion spec")
  return keys


def nest(flat: dict[str, Any]) -> Any:
  """A nested tree from keystr paths.

  ``['k']`` is a dict key, ``[0]`` a list index (a level whose keys are
  exactly ``0..n-1`` becomes a list), ``.name`` a dict key; a tree that was a
  single leaf (path ``""``) is that leaf.

  >>> nest({"['a'][0].b": 1, "['a'][1].b": 2, "['c']": 3})
  {'a': [{'b': 1}, {'b': 2}], 'c': 3}
  """
  if list(flat) == [""]:
    return flat[""]            # the whole tree was one leaf
  root: dict = {}
  for path, value in flat.items():
    node, keys = root, path_keys(path)
    for k in keys[:-1]:
      node = node.setdefault(k, {})
      if not isinstance(node, dict):
        raise errors.ConversionError(f"leaf path {path!r} runs through another leaf at key {k!r}")
    if keys[-1] in node:
      raise errors.ConversionError(f"leaf path {path!r} is also the prefix of other leaves")
    node[keys[-1]] = value
  return _lists(root)


def _lists(node: Any) -> Any:
  if not isinstance(node, dict):
    return node
  out = {k: _lists(v) for k, v in node.items()}
  if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
    return [out[i] for i in range(len(out))]
  return out
