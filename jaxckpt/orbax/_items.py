"""orbax's ``args=`` forms as one jaxckpt tree: StandardSave, PyTreeSave, JsonSave,
Grain's CheckpointSave, and a Composite of them.

A Composite is saved as one tree ``{name: item}`` (one step, one commit, every
tier: host snapshot, agent, parity, storage), and the kind of each item is
recorded in the step's metadata under ``_ITEMS_KEY`` so that a restore can
say what it restores. Pytree items are stored as they are; a JSON item and a
Grain iterator's state are stored as bytes: one row of ``ROW_BYTES`` per
process (a data iterator's position is each process's own), in a
``(process_count, ROW_BYTES)`` uint8 array, sharded over processes when
there are several. Each row is an 8-byte length and the UTF-8 JSON.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt import errors

_ITEMS_KEY = "jaxckpt.items"
ROW_BYTES = 1 << 16          # a Grain iterator's state is a few hundred bytes of JSON
_LEN_BYTES = 8

PYTREE, JSON, GRAIN = "pytree", "json", "grain"
_SAVE_KINDS = {"StandardSaveArgs": PYTREE, "PyTreeSaveArgs": PYTREE, "JsonSaveArgs": JSON,
               "CheckpointSave": GRAIN}
_RESTORE_KINDS = {"StandardRestoreArgs": PYTREE, "PyTreeRestoreArgs": PYTREE,
                  "JsonRestoreArgs": JSON, "CheckpointRestore": GRAIN}


def is_composite(args: Any) -> bool:
  return type(args).__name__ in ("Composite", "CompositeArgs")


def _kind(arg: Any, kinds: dict[str, str], verb: str, name: str) -> str:
  kind = kinds.get(type(arg).__name__)
  if kind is None:
    raise errors.InvalidArgumentError(
        f"{verb}(args=Composite({name}={type(arg).__name__}(...))): jaxckpt takes the item "
        f"kinds orbax users give a CheckpointManager: {sorted(kinds)}; save anything else as "
        "a pytree (ocp.args.StandardSave) or JSON (ocp.args.JsonSave)")
  return kind


def to_tree(args: Any, metadata: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
  """The tree and metadata that save ``Composite`` ``args`` as one step."""
  tree, kinds = {}, {}
  for name in args.keys():
    arg = args[name]
    kind = kinds[name] = _kind(arg, _SAVE_KINDS, "save", name)
    if kind == PYTREE:
      tree[name] = arg.item
    elif kind == JSON:
      tree[name] = _rows(json.dumps(arg.item, sort_keys=True).encode(), name)
    else:
      tree[name] = _rows(_grain_state(arg.item), name)
  meta = dict(metadata or {})
  meta[_ITEMS_KEY] = kinds
  return tree, meta


def restore(args: Any, saved_meta: dict[str, Any],
            read: Callable[[dict[str, Any]], dict[str, Any]], describe: Callable[[str], Any]) -> Any:
  """Restores ``Composite`` ``args``: ``read(target)`` restores a partial tree,
  ``describe(name)`` is the saved structure of item ``name``. Returns a
  Composite of the restored items (Grain iterators restored in place)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel  (orbax's own type, only for its users)
  saved = saved_meta.get(_ITEMS_KEY) or {}
  target, kinds = {}, {}
  for name in args.keys():
    arg = args[name]
    kind = kinds[name] = _kind(arg, _RESTORE_KINDS, "restore", name)
    if name not in saved:
      raise errors.StructureMismatchError(
          f"restore(args=Composite({name}=...)): the step holds no item {name!r} (it holds "
          f"{sorted(saved) or 'one plain tree, saved without Composite'})")
    if saved[name] != kind:
      raise errors.StructureMismatchError(
          f"restore(args=Composite({name}={type(arg).__name__}(...))): item {name!r} was "
          f"saved as {saved[name]}, not {kind}")
    target[name] = arg.item if kind == PYTREE else _rows_target(describe(name))
  out = read(target)
  items = {}
  for name, kind in kinds.items():
    if kind == PYTREE:
      items[name] = out[name]
    elif kind == JSON:
      items[name] = json.loads(_my_row(out[name], name))
    else:
      items[name] = _set_grain_state(args[name].item, _my_row(out[name], name))
  return ocp.args.Composite(**items)


def _grain_state(it: Any) -> bytes:
  if not hasattr(it, "get_state"):
    raise errors.InvalidArgumentError(
        f"grain.checkpoint.CheckpointSave({type(it).__name__}): not a Grain iterator (it has "
        "no get_state()); pass the iterator of a grain.DataLoader or a grain dataset")
  state = it.get_state()
  return state if isinstance(state, bytes) else json.dumps(state).encode()


def _set_grain_state(it: Any, data: bytes) -> Any:
  if not hasattr(it, "set_state"):
    raise errors.InvalidArgumentError(
        f"grain.checkpoint.CheckpointRestore({type(it).__name__}): not a Grain iterator (no "
        "set_state()); pass a fresh iterator of the same DataLoader or dataset")
  # A DataLoader's iterator speaks bytes, a dataset iterator a dict: as it does now.
  it.set_state(data if isinstance(it.get_state(), bytes) else json.loads(data))
  return it


def _rows(data: bytes, name: str) -> Any:
  """This process's ``data`` as its row of the item's (process_count, ROW_BYTES) array."""
  if len(data) > ROW_BYTES - _LEN_BYTES:
    raise errors.InvalidArgumentError(
        f"save(args=Composite({name}=...)): the item is {len(data)} bytes of JSON, over the "
        f"{ROW_BYTES - _LEN_BYTES} a JSON or data-iterator item holds; save large values as "
        "arrays (ocp.args.StandardSave)")
  row = np.zeros(ROW_BYTES, np.uint8)
  row[:_LEN_BYTES] = np.frombuffer(len(data).to_bytes(_LEN_BYTES, "little"), np.uint8)
  row[_LEN_BYTES:_LEN_BYTES + len(data)] = np.frombuffer(data, np.uint8)
  count = jax.process_count()
  if count == 1:
    return row[None]
  return jax.make_array_from_process_local_data(_process_sharding(), row[None],
                                                (count, ROW_BYTES))


def _process_sharding() -> jax.sharding.NamedSharding:
  """Rows over processes (each process's devices hold its own row)."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  grid = np.array(devices).reshape(jax.process_count(), -1)
  mesh = jax.sharding.Mesh(grid, ("process", "local"))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process"))


def _rows_target(saved: Any) -> Any:
  count = jax.process_count()
  if tuple(saved.shape) != (count, ROW_BYTES):
    raise errors.StructureMismatchError(
        f"the step's data item was saved by {saved.shape[0]} processes and this job has "
        f"{count}: a data iterator's position is each process's own; restore it with the "
        "same number of processes (or restore the other items alone)")
  if count == 1:
    return np.zeros((1, ROW_BYTES), np.uint8)
  return jax.ShapeDtypeStruct((count, ROW_BYTES), np.uint8, sharding=_process_sharding())


def _my_row(arr: Any, name: str) -> bytes:
  row = (np.asarray(arr)[0] if isinstance(arr, np.ndarray)
         else np.asarray(arr.addressable_shards[0].data)[0])
  n = int.from_bytes(row[:_LEN_BYTES].tobytes(), "little")
  if n > ROW_BYTES - _LEN_BYTES:
    raise errors.CorruptSnapshotError(f"item {name!r}: a row claims {n} bytes; it is damaged")
  return row[_LEN_BYTES:_LEN_BYTES + n].tobytes()
