"""The restore target of one item, leaf by leaf, from orbax's restore args.

orbax describes what a restore gives back with a reference tree (``item``: arrays,
``jax.ShapeDtypeStruct``, anything else meaning "as saved", and
``ocp.PLACEHOLDER`` for a leaf left out) and per-leaf ``restore_args``
(``ArrayRestoreArgs``: a sharding or a mesh and its axes, a dtype; ``RestoreArgs``:
a ``restore_type``). Either may be missing: without an ``item`` the restore args
give the structure, and without both the item comes back as saved. A :class:`Plan`
is the flat target that reads those leaves (``{saved path: target leaf}``) and
the function that builds the result from what was read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt import errors, tree
from jaxckpt.host.snapshot import dtype_from_name

PLACEHOLDER = ...                     # orbax's ocp.PLACEHOLDER
_PYTHON_SCALARS = (bool, int, float, complex)


@dataclasses.dataclass
class Plan:
  """What to read (``{saved path: target leaf}``) and how to build the item from the values."""

  target: dict[str, Any]
  finish: Callable[[dict[str, Any]], Any]


def as_saved(rec: Any) -> Any:
  """The target leaf that gives a saved leaf back as ``restore(target=None)`` does: an
  array as a numpy array, a PRNG key as a key, a scalar as it is."""
  if rec.kind == "scalar":
    return None
  return np.broadcast_to(np.zeros((), dtype_from_name(rec.dtype)), tuple(rec.shape))


def _sharding(r: Any) -> Any:
  sharding = getattr(r, "sharding", None)
  mesh = getattr(r, "mesh", None)
  if sharding is None and mesh is not None:
    axes = getattr(r, "mesh_axes", None)
    sharding = jax.sharding.NamedSharding(
        mesh, axes if axes is not None else jax.sharding.PartitionSpec())
  return sharding


def _leaf_target(x: Any, rec: Any, r: Any) -> Any:
  """The target of one saved leaf ``rec`` from the item's leaf ``x`` and its restore args ``r``."""
  if rec.kind == "scalar":
    return None
  if r is not None:
    if getattr(r, "restore_type", None) is np.ndarray:
      return np.broadcast_to(np.zeros((), dtype_from_name(rec.dtype)), tuple(rec.shape))
    sharding = _sharding(r)
    if sharding is not None:
      shape = getattr(x, "shape", None) if _array_like(x) else None
      dtype = getattr(x, "dtype", None) if _array_like(x) else None
      if rec.kind == "prng_key" and (dtype is None or not tree.is_prng_key(x)):
        shape, dtype = tuple(rec.shape), dtype_from_name(rec.dtype)    # the key's data
      return jax.ShapeDtypeStruct(tuple(rec.shape) if shape is None else tuple(shape),
                                  dtype_from_name(rec.dtype) if dtype is None else dtype,
                                  sharding=sharding)
  if _array_like(x):
    return x
  return as_saved(rec)


def _array_like(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic))


def _finish_leaf(value: Any, r: Any, rec: Any) -> Any:
  """A read value cast as the restore args say (``restore_type``, ``dtype``)."""
  rtype = getattr(r, "restore_type", None)
  if rtype in _PYTHON_SCALARS and rec.kind != "scalar":
    return rtype(np.asarray(value).item())
  if rtype in _PYTHON_SCALARS and not isinstance(value, rtype):
    return rtype(value)
  dtype = getattr(r, "dtype", None)
  if dtype is not None and rec.kind != "scalar" and np.dtype(dtype) != value.dtype:
    return value.astype(dtype)
  return value


def _mismatch(prefix: str, detail: str) -> errors.StructureMismatchError:
  where = f" of item {prefix}" if prefix else ""
  return errors.StructureMismatchError(
      f"User-provided restore item and on-disk value metadata tree structures do not "
      f"match{where}: {detail}; pass the saved structure (with ocp.PLACEHOLDER for a leaf to "
      "leave out), or partial_restore=True to restore a part of it")


def pytree_plan(arg: Any, prefix: str, saved: dict[str, Any], partial: bool) -> Plan:
  """A pytree item (``StandardRestore``/``PyTreeRestore``, or None: as saved) under ``prefix``."""
  rel = {p[len(prefix):]: rec for p, rec in saved.items()}
  item = getattr(arg, "item", None)
  rargs = getattr(arg, "restore_args", None)
  partial = partial or bool(getattr(arg, "partial_restore", False))
  if item is None and rargs is None:
    return Plan({prefix + p: as_saved(rec) for p, rec in rel.items()},
                lambda v: tree.nest({p: v[prefix + p] for p in rel}))
  by_path = {}
  if rargs is not None:
    by_path = {jax.tree_util.keystr(p): r for p, r in jax.tree_util.tree_flatten_with_path(
        rargs, is_leaf=lambda x: x is None)[0]}
  ref = item if item is not None else rargs
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(ref)
  leaves = [(jax.tree_util.keystr(p), x) for p, x in with_paths]
  asked = {p for p, x in leaves}
  for p, x in leaves:
    if p not in rel:
      inner = [q for q in rel if q.startswith(p)] if p else list(rel)
      if x is PLACEHOLDER and inner:
        raise _mismatch(prefix, f"{p} is a placeholder where a subtree was saved ({inner[0]}, "
                        "...); a placeholder stands for one leaf")
      raise _mismatch(prefix, f"the item has {p}, which was not saved (saved: "
                      f"{sorted(rel)[:6]}{' ...' if len(rel) > 6 else ''})")
  if not partial:
    missing = sorted(p for p in rel if p not in asked)
    if missing:
      raise _mismatch(prefix, f"the item lacks {missing[0]}"
                      + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
  target = {prefix + p: _leaf_target(x, rel[p], by_path.get(p))
            for p, x in leaves if x is not PLACEHOLDER}

  def finish(values: dict[str, Any]) -> Any:
    return treedef.unflatten([
        PLACEHOLDER if x is PLACEHOLDER else
        _finish_leaf(values[prefix + p], by_path.get(p), rel[p]) for p, x in leaves])
  return Plan(target, finish)


def array_plan(arg: Any, prefix: str, saved: dict[str, Any]) -> Plan:
  """An ``ArraySave`` item (``ArrayRestore``, or None: as saved)."""
  rec = saved.get(prefix)
  if rec is None or rec.kind == "scalar":
    raise errors.StructureMismatchError(f"item {prefix or 'default'} holds no array")
  r = getattr(arg, "restore_args", None)
  item = getattr(arg, "item", None)
  return Plan({prefix: _leaf_target(item, rec, r)},
              lambda v: _finish_leaf(v[prefix], r, rec))
