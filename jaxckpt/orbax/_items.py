"""orbax's ``args=`` forms as one jaxckpt tree, and back.

A save's args become one tree (one step, one commit, on every tier: host
snapshot, agent, parity, storage), and the step's metadata records each item's
kind, so that a restore knows what it restores:

- a single (default) item: ``StandardSave``/``PyTreeSave`` (the tree itself),
  ``ArraySave`` (the array), ``JsonSave`` (its JSON text, one string leaf),
  Grain's ``CheckpointSave`` (its state, one row per process); its kind is under
  ``ITEM_KEY``;
- a ``Composite``: the tree ``{name: item}``, the kinds under ``ITEMS_KEY``.

A JSON item is one value for the whole job, as orbax writes it (restored at any
process count). A Grain iterator's state is each process's own: a
``(process_count, ROW_BYTES)`` uint8 array, sharded over processes, each row an
8-byte length and the UTF-8 state; it is restored by the same number of processes.

:class:`Forms` keeps what an orbax manager knows of its items (single or several,
declared ``item_names``, the kinds it has saved or restored) and checks the args
as orbax does; :mod:`jaxckpt.orbax._targets` turns the restore args of a pytree
item into a target leaf by leaf.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt import errors, tree
from jaxckpt.core import _ledger
from jaxckpt.orbax import _targets
# the item records and the row encoding, which reading an orbax step in place shares
from jaxckpt.universal._saved_items import ITEM_KEY, ITEMS_KEY, ROW_BYTES, encode_row

TIME_KEY, METRICS_KEY = _ledger.TIME_KEY, _ledger.METRICS_KEY   # a step's time and metrics
DEFAULT = "default"               # orbax's name of the single item
_LEN_BYTES = 8

PYTREE, JSON, ARRAY, GRAIN = "pytree", "json", "array", "grain"
_SAVE_KINDS = {"StandardSaveArgs": PYTREE, "PyTreeSaveArgs": PYTREE, "JsonSaveArgs": JSON,
               "ArraySaveArgs": ARRAY, "CheckpointSave": GRAIN}
_RESTORE_KINDS = {"StandardRestoreArgs": PYTREE, "PyTreeRestoreArgs": PYTREE,
                  "JsonRestoreArgs": JSON, "ArrayRestoreArgs": ARRAY, "CheckpointRestore": GRAIN}
_HANDLER_KINDS = {"StandardCheckpointHandler": PYTREE, "PyTreeCheckpointHandler": PYTREE,
                  "JsonCheckpointHandler": JSON, "ArrayCheckpointHandler": ARRAY}


def is_composite(args: Any) -> bool:
  return type(args).__name__ in ("Composite", "CompositeArgs")


def _is_args(x: Any) -> bool:
  """Whether ``x`` is one of orbax's CheckpointArgs (by its classes' names: no import)."""
  return any(c.__name__ == "CheckpointArgs" for c in type(x).__mro__)


def _kind(arg: Any, kinds: dict[str, str], verb: str, name: str) -> str:
  kind = kinds.get(type(arg).__name__)
  if kind is None:
    raise errors.InvalidArgumentError(
        f"{verb}(args=Composite({name}={type(arg).__name__}(...))): jaxckpt takes the item "
        f"kinds orbax users give a CheckpointManager: {sorted(kinds)}; save anything else as "
        "a pytree (ocp.args.StandardSave) or JSON (ocp.args.JsonSave)")
  return kind


def user_metadata(meta: dict[str, Any]) -> dict[str, Any]:
  """A step's metadata without jaxckpt's own keys (orbax's ``custom_metadata``)."""
  return {k: v for k, v in meta.items() if not k.startswith("jaxckpt.")}


class Forms:
  """What an orbax manager knows of its items, and the args checks orbax makes.

  ``single`` is None until the first save or restore says whether the manager
  holds one unnamed item (True) or a Composite of named ones (False), as in orbax;
  ``item_names=`` declares the names (False), a single ``item_handlers=`` handler
  one item (True).
  """

  def __init__(self, item_names: Any = None, item_handlers: Any = None) -> None:
    if item_names is not None and item_handlers is not None and not isinstance(
        item_handlers, dict):
      raise errors.InvalidArgumentError(
          "CheckpointManager(item_names=..., item_handlers=<one handler>): a single "
          "handler is the single, unnamed (default) item; `item_handlers` in default item "
          "mode and `item_names` should not be provided together")
    self.names = None if item_names is None else tuple(item_names)
    self.known: dict[str, str] = {}            # item name -> kind, as saved or restored here
    self.single: bool | None = None
    if isinstance(item_handlers, dict):
      self.names = tuple(dict.fromkeys((*(self.names or ()), *item_handlers)))
      self.known.update({n: k for n, h in item_handlers.items()
                         if (k := _HANDLER_KINDS.get(type(h).__name__))})
    elif item_handlers is not None:
      self.single = True
      if (k := _HANDLER_KINDS.get(type(item_handlers).__name__)):
        self.known[DEFAULT] = k
    if self.names is not None:
      self.single = False

  def _mode(self, composite: bool) -> None:
    if self.single is None:
      self.single = not composite
    elif self.single and composite:
      raise errors.InvalidArgumentError(
          "Cannot provide `args` of type `Composite` when dealing with a single, unnamed "
          "(default) checkpointable object. This manager saved or restored one item; pass "
          "its args alone (args=ocp.args.StandardSave(state)), or use another manager")
    elif not self.single and not composite:
      raise errors.InvalidArgumentError(
          "Must provide `args` of type `Composite` when dealing with multiple checkpointable "
          f"objects (this manager holds items {list(self.names or self.known) or 'by name'}): "
          "args=ocp.args.Composite(name=ocp.args.StandardSave(...), ...)")

  # -- save ---------------------------------------------------------------

  def save(self, state: Any, args: Any, metadata: dict[str, Any] | None
           ) -> tuple[Any, dict[str, Any] | None]:
    """The tree and metadata that save ``state`` (a plain tree) or orbax's ``args``."""
    if args is None:
      if state is None:
        raise errors.InvalidArgumentError(
            "save() needs the state: save(step, state), or orbax's "
            "save(step, args=ocp.args.StandardSave(state))")
      if _is_args(state):
        raise errors.InvalidArgumentError(
            f"save(step, {type(state).__name__}(...)): orbax's args go by keyword, "
            "save(step, args=...); a positional one is taken as the tree itself")
      return state, metadata
    if state is not None:
      raise errors.InvalidArgumentError(
          "save() got both the state and args=; pass one (args=ocp.args.StandardSave(state) "
          "is the orbax form of the state)")
    if not _is_args(args):
      raise errors.InvalidArgumentError(
          f"save(args={type(args).__name__}): expected orbax's CheckpointArgs "
          "(ocp.args.StandardSave(state), ocp.args.Composite(...))")
    composite = is_composite(args)
    self._mode(composite)
    meta = dict(metadata or {})
    if not composite:
      kind = _kind(args, _SAVE_KINDS, "save", DEFAULT)
      self.known[DEFAULT] = meta[ITEM_KEY] = kind
      return _save_value(kind, args, DEFAULT), meta
    out, kinds = {}, {}
    for name in args.keys():
      arg = args[name]
      if self.names is not None and name not in self.names:
        raise errors.InvalidArgumentError(
            f"save(args=Composite({name}=...)): item {name!r} does not match with any "
            f"registered handler: this manager's item_names are {list(self.names)}; add it "
            "to item_names, or save it under one of them")
      if arg is None:
        raise errors.InvalidArgumentError(f"save(args=Composite({name}=None)): nothing to save")
      kinds[name] = _kind(arg, _SAVE_KINDS, "save", name)
      out[name] = _save_value(kinds[name], arg, name)
    self.known.update(kinds)
    meta[ITEMS_KEY] = kinds
    return out, meta

  # -- restore ------------------------------------------------------------

  def restore(self, args: Any, target: Any, partial: bool, leaves: dict[str, Any],
              meta: dict[str, Any], read: Callable[[Any, bool], Any]) -> Any:
    """Restores a step given as its flat ``leaves`` metadata ({path: LeafMetadata})
    and its ``meta``; ``read(target, partial)`` reads it onto a target."""
    items = meta.get(ITEMS_KEY)
    if args is None:
      if target is not None:
        return read(target, partial)
      if items:
        self._mode(True)
        self.known.update(items)
        return _composite({n: self._plan(n, k, None, leaves, partial) for n, k in items.items()},
                          read)
      kind = meta.get(ITEM_KEY, PYTREE)
      if ITEM_KEY in meta:            # saved through args=: orbax's single item
        self._mode(False)
        self.known.setdefault(DEFAULT, kind)
      return _run(self._plan(DEFAULT, kind, None, leaves, partial), read, partial)
    if target is not None:
      raise errors.InvalidArgumentError(
          "restore() got both target= and args=; pass one (args=ocp.args.StandardRestore("
          "target) is the orbax form of target=)")
    if not _is_args(args):
      raise errors.InvalidArgumentError(
          f"restore(args={type(args).__name__}): expected orbax's CheckpointArgs "
          "(ocp.args.StandardRestore(target), ocp.args.Composite(...))")
    if not is_composite(args):
      self._mode(False)
      if items:
        raise errors.InvalidArgumentError(
            f"restore(args={type(args).__name__}(...)): the step holds a Composite of items "
            f"{sorted(items)}; restore it with args=ocp.args.Composite(name=...)")
      kind = meta.get(ITEM_KEY, PYTREE)
      self._check_kind(args, kind, DEFAULT)
      self.known[DEFAULT] = kind
      return _run(self._plan(DEFAULT, kind, args, leaves, partial), read, partial)
    self._mode(True)
    if not items:
      raise errors.InvalidArgumentError(
          "restore(args=Composite(...)): the step holds one item, saved without Composite; "
          "restore it with args=ocp.args.StandardRestore(target) (or the args it was saved "
          "with)")
    plans = {}
    for name in args.keys():
      arg = args[name]
      if name not in items:
        raise errors.ItemNotFoundError(
            f"restore(args=Composite({name}=...)): the step holds no item {name!r} (it holds "
            f"{sorted(items)})")
      if arg is None and name not in self.known:
        raise errors.InvalidArgumentError(
            f"Provided `None` for `CheckpointArgs`, and the `CheckpointHandler` for item "
            f"\"{name}\" was not configured. This manager has not saved or restored item "
            f"{name!r} yet: pass its restore args (e.g. {name}=ocp.args.StandardRestore()), "
            "or restore(step) without args for every item")
      if arg is not None:
        self._check_kind(arg, items[name], name)
      self.known[name] = items[name]
      plans[name] = self._plan(name, items[name], arg, leaves, partial)
    return _composite(plans, read)

  def _check_kind(self, arg: Any, saved: str, name: str) -> None:
    kind = _kind(arg, _RESTORE_KINDS, "restore", name)
    if kind != saved:
      raise errors.StructureMismatchError(
          f"restore(args={type(arg).__name__}(...)): item {name!r} was saved as {saved}, "
          f"not {kind}; restore it with the args of its kind")

  def _plan(self, name: str, kind: str, arg: Any, leaves: dict[str, Any],
            partial: bool) -> "_targets.Plan":
    prefix = "" if name == DEFAULT and not _under(leaves, name) else f"[{name!r}]"
    mine = {p: m for p, m in leaves.items() if p.startswith(prefix)}
    if kind == PYTREE:
      return _targets.pytree_plan(arg, prefix, mine, partial)
    if kind == ARRAY:
      return _targets.array_plan(arg, prefix, mine)
    if kind == JSON:
      return _targets.Plan({prefix: None if _scalar(mine, prefix) else _rows_target(mine[prefix])},
                           lambda v: json.loads(_json_text(v[prefix], name)))
    if (rec := mine.get(prefix)) is None:
      raise errors.ManifestError(f"item {name!r}: its Grain state is missing from the step")
    it = getattr(arg, "item", None)
    return _targets.Plan({prefix: _rows_target(rec)},
                         lambda v: _set_grain_state(it, _my_row(v[prefix], name))
                         if it is not None else _state(_my_row(v[prefix], name)))

  def item_metadata(self, leaves: dict[str, Any], meta: dict[str, Any]) -> Any:
    """orbax's ``StepMetadata.item_metadata``: a Composite of each item's structure, or the
    single item's structure once this manager knows it (None before, as orbax's)."""
    items = meta.get(ITEMS_KEY)
    if items:
      import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel  (orbax's own type, only for its users)
      return ocp.args.Composite(**{
          n: tree.nest({p[len(f"[{n!r}]"):]: m for p, m in leaves.items()
                        if p.startswith(f"[{n!r}]")}) for n in items})
    if DEFAULT not in self.known:
      return None
    return tree.nest(dict(leaves)) if leaves else None


def _under(leaves: dict[str, Any], name: str) -> bool:
  return any(p.startswith(f"[{name!r}]") for p in leaves)


def _scalar(mine: dict[str, Any], path: str) -> bool:
  rec = mine.get(path)
  if rec is None:
    raise errors.ManifestError(f"the step holds no leaf {path!r} for its JSON item")
  return rec.kind == "scalar"


def _composite(plans: dict[str, "_targets.Plan"], read: Callable[[Any, bool], Any]) -> Any:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel  (orbax's own type, only for its users)
  target = tree.FlatTarget()
  for plan in plans.values():
    target.update(plan.target)
  values = read(target, True)
  return ocp.args.Composite(**{n: plan.finish(values) for n, plan in plans.items()})


def _run(plan: "_targets.Plan", read: Callable[[Any, bool], Any], partial: bool) -> Any:
  return plan.finish(read(tree.FlatTarget(plan.target), True))


def _save_value(kind: str, arg: Any, name: str) -> Any:
  if kind == PYTREE:
    if arg.item is None:
      raise errors.InvalidArgumentError(f"save(args={type(arg).__name__}(None)) for item "
                                        f"{name!r}: nothing to save")
    return arg.item
  if kind == ARRAY:
    if not hasattr(arg.item, "shape"):
      raise errors.InvalidArgumentError(
          f"save(args=ArraySave({type(arg.item).__name__})) for item {name!r}: an ArraySave "
          "item is a jax or numpy array")
    return arg.item
  if kind == JSON:
    return json.dumps(arg.item)
  return _rows(_grain_state(arg.item), name)


def _json_text(value: Any, name: str) -> str:
  if isinstance(value, str):
    return value
  return _my_row(value, name).decode()      # a step of an older jaxckpt: one row per process


def _state(data: bytes) -> Any:
  try:
    return json.loads(data)
  except ValueError:
    return data


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
  row = encode_row(data, name)
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
        f"the step's data iterator was saved by {saved.shape[0]} processes and this job has "
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
