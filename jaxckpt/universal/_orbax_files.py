"""An orbax checkpoint's files, read where they lie: one step's items, tree, arrays and records.

Orbax's own metadata API gives the tree, shapes and dtypes of a pytree item; each
array is then opened lazily as the tensorstore array orbax wrote (zarr, inside OCDBT
when orbax used it), so a read fetches only the regions it asks for and no host holds a
whole tensor. JSON, array and Grain iterator items are read from their files. What a
step yields (:class:`OrbaxStep`: leaves, a source per array, the metadata a jaxckpt step
of it carries) is what a restore reads in place (``_orbax_read``: a jaxckpt manager
opened on an orbax directory) and what :mod:`jaxckpt.orbax.interop` copies into the
universal format (``jaxckpt import-orbax``).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxckpt import errors
from jaxckpt.tree import path_keys
from jaxckpt.universal import _failures
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _local
from jaxckpt.universal import _manifest as man
from jaxckpt.universal import _orbax_steps
from jaxckpt.universal import _saved_items

log = logging.getLogger(__name__)

READ_TIMEOUT_SECS = 600.0


_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")
METRICS_ITEM = "metrics"     # orbax's manager saves save(metrics=...) as this JSON item
_STEP_NAME = re.compile(r"(?:.*_)?(\d+)")


@dataclasses.dataclass
class _Source:
  """What an import reads: the orbax step (None for a bare checkpointer save), its items
  (``{name: (kind, dir, handler)}``, kind None for one import_orbax cannot read), whether
  they are one item or a Composite, the step's ``_CHECKPOINT_METADATA`` and the directory
  of orbax's ``metrics`` item (the step's metrics, not an item of the user's)."""

  step: int | None
  items: dict[str, tuple]
  single: bool
  step_meta: dict[str, Any]
  metrics_dir: str | None = None


def local_dir(orbax_dir: str, *, writing: bool = False) -> str:
  """The absolute path of an orbax checkpoint directory (orbax reads a relative path as no
  tree at all; ``file://`` is a local path). A URL is refused: orbax's side of import and
  export is a local directory (its files are read here with ``os``), and the absolute path
  of ``gs://b/x`` was ``./gs:/b/x``, where an export wrote and an import found nothing.

  Raises:
    InvalidArgumentError: ``orbax_dir`` is a URL, naming what to do instead.
  """
  if "://" in orbax_dir and not orbax_dir.startswith("file://"):
    how = (f"export to a local directory and copy that (e.g. gcloud storage cp -r DIR "
           f"{orbax_dir})" if writing else
           f"copy it to a local directory first (e.g. gcloud storage cp -r {orbax_dir} DIR) "
           "and import that")
    raise errors.InvalidArgumentError(
        f"orbax checkpoint {orbax_dir!r} is a URL: jaxckpt {'writes' if writing else 'reads'} "
        f"orbax checkpoints in local directories only; {how}")
  return os.path.abspath(orbax_dir.removeprefix("file://"))


def not_importable(orbax_dir: str) -> str | None:
  """Why ``orbax_dir`` is not a directory import_orbax reads (it does not exist, a jaxckpt
  checkpoint, or a step or item directory inside an orbax CheckpointManager directory), naming
  what to pass; or None."""
  if not os.path.lexists(orbax_dir):
    return (f"{orbax_dir!r} does not exist; pass the directory of an orbax checkpoint (a "
            "CheckpointManager directory, or one StandardCheckpointer save)")
  up = orbax_dir
  for _ in range(4):                 # a jaxckpt checkpoint, or a directory inside one
    if os.path.isdir(os.path.join(up, lay.COMMITS_PREFIX)):
      where = "" if up == orbax_dir else f" (inside the jaxckpt checkpoint {up!r})"
      return (f"{orbax_dir!r} is a jaxckpt checkpoint (universal format){where}, not an orbax "
              f"one: no import is needed; restore it with jaxckpt.CheckpointManager({up!r}) or "
              f"look at it with: jaxckpt inspect {up}")
    up = os.path.dirname(up)
  if os.path.exists(os.path.join(orbax_dir, "_METADATA")):
    return None                      # a pytree save: imported as it is
  def step_dir(d: str) -> int | None:
    m = _STEP_NAME.fullmatch(os.path.basename(d))
    finalized = os.path.exists(os.path.join(d, "_CHECKPOINT_METADATA"))
    return int(m.group(1)) if m and finalized else None
  parent = os.path.dirname(orbax_dir)
  if (n := step_dir(orbax_dir)) is not None:
    root, extra = parent, f"--step {n}"
    what = f"step {n}'s directory of the orbax CheckpointManager directory {root!r}"
  elif (n := step_dir(parent)) is not None:
    root, name = os.path.dirname(parent), os.path.basename(orbax_dir)
    extra = f"--step {n} --item {name}"
    what = f"item {name!r} of step {n} of the orbax CheckpointManager directory {root!r}"
  else:
    return None
  return (f"{orbax_dir!r} is {what}, not its root; pass the root: "
          f"jaxckpt import-orbax {root} DST {extra}")


def _step_items(orbax_dir: str, step: int | None
                ) -> tuple[int | None, dict[str, tuple], dict[str, Any]]:
  """The step (None for a bare checkpointer save), its items (``{name: (kind, dir,
  handler)}``, kind None for an item import_orbax cannot read) and its metadata."""
  if not os.path.lexists(orbax_dir):
    raise errors.StepNotFoundError(
        f"{orbax_dir!r} does not exist; pass the directory of an orbax checkpoint (a "
        "CheckpointManager directory, or one StandardCheckpointer save)")
  if not os.path.isdir(orbax_dir):
    raise errors.InvalidArgumentError(
        f"{orbax_dir!r} is not a directory; pass the directory of an orbax checkpoint (a "
        "CheckpointManager directory, or one StandardCheckpointer save)")
  if (why := not_importable(orbax_dir)):
    raise errors.InvalidArgumentError(why)
  if os.path.exists(os.path.join(orbax_dir, "_METADATA")):
    return None, {"": ("pytree", orbax_dir, None)}, {}
  held = _orbax_steps.orbax_steps(orbax_dir)      # as a manager lists them: no link followed
  steps = sorted(held)
  if not steps:
    raise errors.StepNotFoundError(
        f"{orbax_dir!r} holds neither an orbax checkpoint (_METADATA) nor finalized "
        "CheckpointManager steps")
  if step is None:
    step = max(steps)
  elif step not in steps:
    raise errors.StepNotFoundError(f"orbax step {step} is not in {orbax_dir!r}; it has {steps}")
  return (step, *step_dir_items(held[step]))


def step_dir_items(step_dir: str) -> tuple[dict[str, tuple], dict[str, Any]]:
  """The items of one finalized step directory of an orbax CheckpointManager (``{name: (kind,
  dir, handler)}``, kind None for an item import_orbax cannot read) and its metadata
  (``_CHECKPOINT_METADATA``). Links are not followed: an item that is one is not listed."""
  try:
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), encoding="utf-8") as f:
      step_meta = json.load(f)
  except (OSError, ValueError):
    step_meta = {}
  step_meta = step_meta if isinstance(step_meta, dict) else {}
  handlers = step_meta.get("item_handlers") or {}
  items = {}
  for name in sorted(os.listdir(step_dir)):
    where = os.path.join(step_dir, name)
    if (os.path.isdir(where) and not os.path.islink(where)
        and "orbax-checkpoint-tmp" not in name):
      handler = handlers.get(name) if isinstance(handlers, dict) else None
      items[name] = (_item_kind(where, handler), where, handler)
  return items, step_meta


def _item_kind(item_dir: str, handler: str | None) -> str | None:
  """What an orbax item holds, from the handler that saved it (else from its files)."""
  h = handler or ""
  if any(n in h for n in _PYTREE_HANDLERS) or (not h and os.path.exists(
      os.path.join(item_dir, "_METADATA"))):
    return "pytree"
  if "JsonCheckpointHandler" in h:
    return "json"
  if "ArrayCheckpointHandler" in h:
    return "array"
  if "grain" in h or (not h and glob.glob(os.path.join(item_dir, "process_*-of-*.json"))):
    return "grain"
  return None


def selected(orbax_dir: str, step: int | None, item: str | None) -> _Source:
  """The items to import and whether they are one (the step's only item, orbax's
  ``default``, or ``item``) or a Composite. Without ``item``, orbax's ``metrics`` item
  beside others is the step's metrics (orbax's manager reads it so), not an item."""
  found, items, step_meta = _step_items(orbax_dir, step)
  return _pick(found, items, step_meta, item, orbax_dir)


def _pick(found: int | None, items: dict[str, tuple], step_meta: dict[str, Any],
          item: str | None, where: str) -> _Source:
  """:func:`selected`'s choice among the ``items`` of step ``found`` of ``where``."""
  metrics_dir = None
  if item is None and len(items) > 1 and items.get(METRICS_ITEM, (None,))[0] == "json":
    metrics_dir = items.pop(METRICS_ITEM)[1]
  if item is not None:
    if item not in items:
      raise errors.StepNotFoundError(
          f"orbax step {found} in {where!r} has items {sorted(items)}; pick one with "
          "item= (--item), or none to import them all")
    items = {item: items[item]}
  cannot = {n: h for n, (kind, _, h) in items.items() if kind is None}
  if cannot:
    raise errors.InvalidArgumentError(
        f"orbax step {found} in {where!r}: import-orbax cannot import item(s) "
        + ", ".join(f"{n!r} (saved by {h or 'an unknown handler'})" for n, h in cannot.items())
        + f"; it imports pytree, JSON, array and Grain iterator items: import the others one "
        f"at a time with --item NAME (items: {sorted(items)})")
  if not items:
    raise errors.ManifestError(f"orbax step {found} in {where!r} holds no items")
  _check_no_links(where, found is None, [d for _, d, _ in items.values()])
  single = item is not None or list(items) in ([""], ["default"])
  return _Source(found, items, single, step_meta, metrics_dir)


def _check_no_links(orbax_dir: str, bare: bool, item_dirs: list[str]) -> None:
  """Refuses (CorruptSnapshotError) a source whose step directory holds a link or a
  special file anywhere: an import reads the checkpoint's own files, never what a link
  in it points to (a downloaded checkpoint's link to its user's files would be copied
  into the new one, or a FIFO would never answer)."""
  for d in {orbax_dir if bare else os.path.dirname(i) for i in item_dirs}:
    rel = os.path.relpath(d, orbax_dir)
    _local.check_tree(orbax_dir, "" if rel == "." else rel + "/",
                      where=f"importing the orbax checkpoint {orbax_dir!r}")


def _open_orbax_array(item_dir: str, name: str, use_zarr3: bool) -> ts.TensorStore:
  ocdbt = os.path.exists(os.path.join(item_dir, "manifest.ocdbt"))
  base = lay.kvstore_url(item_dir)
  kvstore = {"driver": "ocdbt", "base": base, "path": name} if ocdbt else base + name + "/"
  spec = {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore}
  with _failures.reading(f"orbax array {name!r} in {item_dir!r}", lambda cause: (
      f"orbax array {name!r} in {item_dir!r} cannot be opened ({cause})")):
    return ts.open(spec, open=True, read=True, context=lay.context()).result(
        timeout=READ_TIMEOUT_SECS)


class _Counted:
  """A write source over a tensorstore view of orbax's array ``name`` in ``item_dir``
  (opened on first read, checked against the ``shape`` orbax's metadata gives) that tells
  ``progress`` of every region read. A failed read is damage only when it proves it
  (:mod:`~jaxckpt.universal._failures`)."""

  def __init__(self, item_dir: str, name: str, use_zarr3: bool, progress: Any,
               shape: tuple[int, ...] | None = None, view: ts.TensorStore | None = None):
    self._where, self._name, self._zarr3 = item_dir, name, use_zarr3
    self._view, self._progress = view, progress
    self.shape = tuple(view.shape) if view is not None else tuple(shape or ())

  def _opened(self) -> ts.TensorStore:
    if self._view is None:
      view = _open_orbax_array(self._where, self._name, self._zarr3)
      if tuple(view.shape) != self.shape:
        raise errors.CorruptSnapshotError(
            f"orbax array {self._name!r} in {self._where!r} has shape {list(view.shape)}, its "
            f"item's metadata says {list(self.shape)}: the step is damaged")
      self._view = view
    return self._view

  def __getitem__(self, index: Any) -> np.ndarray:
    view = self._opened()
    with _failures.reading(f"orbax array {self._name!r} in {self._where!r}"):
      arr = np.asarray(view[index].read().result(timeout=READ_TIMEOUT_SECS))
    if self._progress is not None:
      self._progress.update(arr.nbytes)
    return arr


def orbax_key_impls(item_dir: str) -> dict[str, str] | None:
  """The PRNG implementation of every array orbax saved from a typed key, by orbax's param name.

  Orbax (0.11 and later) records it per array in ``array_metadatas/process_N`` (JSON,
  ``ext_metadata.random_key_impl``) and wraps those arrays as typed keys again when it restores;
  this reads the same records. None when the save has no such records (an older orbax).
  """
  files = sorted(glob.glob(os.path.join(item_dir, "array_metadatas", "process_*")))
  if not files:
    return None
  impls = {}
  for f in files:
    with open(f, encoding="utf-8") as fh:
      for entry in json.load(fh).get("array_metadatas", []):
        md = entry.get("array_metadata", {})
        impl = (md.get("ext_metadata") or {}).get("random_key_impl")
        if impl:
          impls[md["param_name"]] = impl
  return impls


def _leaf_from(path: str, md: Any, item_dir: str, use_zarr3: bool, key_impl: str | None = None,
               progress: Any = None) -> tuple[man.LeafInfo, _Counted | None]:
  """One leaf of orbax's metadata tree, and its array's source (opened on first read)."""
  dtype = np.dtype(md.dtype).name
  kind = "jax" if md.sharding is not None else "numpy"
  sharding = None if md.sharding is None else {"orbax": str(md.sharding)}
  if isinstance(md, ocp.metadata.ScalarMetadata):
    value = _Counted(item_dir, md.name, use_zarr3, None, ())[()].item()
    return man.LeafInfo(path=path, kind="scalar", dtype=dtype, value=value), None
  if not isinstance(md, ocp.metadata.ArrayMetadata):
    raise errors.UnsupportedLeafError(
        f"orbax leaf {path!r} in {item_dir!r} is a {type(md).__name__}; import_orbax reads "
        "arrays and scalars (StandardSave trees)")
  storage = getattr(md, "storage", None)
  chunk = getattr(storage, "chunk_shape", None)
  chunk = tuple(chunk) if chunk and len(chunk) == len(md.shape) and min(chunk) > 0 else None
  if key_impl is not None:         # the key's data, as orbax stores a typed key
    kind = "prng_key"
  return (man.LeafInfo(path=path, kind=kind, shape=tuple(md.shape), dtype=dtype,
                       chunk_shape=chunk, sharding=sharding, key_impl=key_impl),
          _Counted(item_dir, md.name, use_zarr3, progress, tuple(md.shape)))


def orbax_tree(item_dir: str) -> tuple[Any, bool]:
  """Orbax's metadata tree of one saved item, and whether it used zarr v3 (read by orbax's
  handler: its checkpointer warns of an item directory's missing step metadata)."""
  from etils import epath  # pylint: disable=import-outside-toplevel  (orbax's path type)
  what = f"orbax item {item_dir!r}: its metadata"
  try:
    with _failures.reading(what):
      meta = ocp.StandardCheckpointHandler().metadata(epath.Path(item_dir))
  except FileNotFoundError as e:          # a finalized step without its item's metadata
    raise errors.CorruptSnapshotError(f"{what} is missing ({e}); restore another step") from None
  meta = getattr(meta, "item_metadata", meta)
  return getattr(meta, "tree", meta), bool(getattr(meta, "use_zarr3", False))


def orbax_nbytes(orbax_dir: str, *, step: int | None = None, item: str | None = None) -> int:
  """Bytes of array data :func:`import_orbax` would copy (for progress bars)."""
  import jax  # pylint: disable=import-outside-toplevel
  total = 0
  for kind, item_dir, _ in selected(local_dir(orbax_dir), step, item).items.values():
    if kind == "array":
      total += sum(i.nbytes for i in _array_item(item_dir, "", None, "plain")[0].values())
    if kind == "pytree":
      tree, _ = orbax_tree(item_dir)
      total += sum(int(np.prod(md.shape)) * np.dtype(md.dtype).itemsize
                   for md in jax.tree_util.tree_leaves(tree)
                   if isinstance(md, ocp.metadata.ArrayMetadata)
                   and not isinstance(md, ocp.metadata.ScalarMetadata))
  return total


_NNX_INDEX = re.compile(r"\['(\d+)'\]")
_NNX_VALUE = "['value']"
LAYOUTS = ("auto", "nnx", "plain")


def nnx_path(orbax_path: str) -> str:
  """The Flax NNX path of a leaf orbax saved from an ``nnx.State``.

  Orbax writes every key of an NNX state as a dict key: list and tuple indices
  as strings and each ``Variable``'s value as a ``'value'`` key. NNX's own
  tree (``nnx.split(nnx.eval_shape(...))``) has int indices and a ``.value``
  attribute, so ``['0']['layers']['1']['kernel']['value']`` becomes
  ``[0]['layers'][1]['kernel'].value``.

  >>> nnx_path("['0']['layers']['1']['kernel']['value']")
  "[0]['layers'][1]['kernel'].value"
  """
  if orbax_path.endswith(_NNX_VALUE):
    orbax_path = orbax_path[:-len(_NNX_VALUE)] + ".value"
  return _NNX_INDEX.sub(r"[\1]", orbax_path)


def _nnx_leaf(path: str, new: str, info: man.LeafInfo, guess_keys: bool) -> man.LeafInfo:
  """``info`` at its NNX path ``new``. With ``guess_keys`` (a save without orbax's key records),
  an RNG stream's key (``...['key'].value``, the two uint32 words of a threefry key, as orbax
  saves NNX's typed keys) becomes a typed PRNG key again."""
  kind, impl = info.kind, info.key_impl
  if (guess_keys and kind != "prng_key" and new.endswith("['key'].value") and info.is_array
      and info.dtype == "uint32" and info.shape[-1:] == (2,)):
    kind, impl = "prng_key", "threefry2x32"
  return dataclasses.replace(info, path=new, kind=kind, key_impl=impl)


def nnx_paths(paths: list[str]) -> dict[str, str]:
  """Each orbax leaf path at its NNX path (:func:`nnx_path`) where it lies in an NNX state, else
  as it is.

  An NNX state is a subtree whose every leaf ends in ``['value']`` below at least one
  attribute, as orbax saves an ``nnx.State``: the whole tree, or a part of a dict that wraps
  it, e.g. ``{"train": nnx.state(...), "data": {...}, "data_key": key}``.

  >>> nnx_paths(["['train']['0']['w']['value']", "['data']['step']"])
  {"['train']['0']['w']['value']": "['train'][0]['w'].value", "['data']['step']": "['data']['step']"}
  """
  keys = {p: path_keys(p) for p in paths}
  out: dict[str, str] = {}

  def walk(depth: int, group: list[str]) -> None:
    if all(len(keys[p]) - depth >= 2 and keys[p][-1] == "value" for p in group):
      for p in group:
        prefix = "".join(f"[{k!r}]" for k in keys[p][:depth])
        out[p] = prefix + nnx_path(p[len(prefix):]) if p.startswith(prefix) else p
      return
    children: dict[Any, list[str]] = {}
    for p in group:
      if len(keys[p]) > depth + 1:
        children.setdefault(keys[p][depth], []).append(p)
      else:
        out[p] = p
    for child in children.values():
      walk(depth + 1, child)

  if paths:
    walk(0, paths)
  return {p: out[p] for p in paths}


def check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise errors.InvalidArgumentError(f"import_orbax layout={layout!r}: expected one of {LAYOUTS}")


@dataclasses.dataclass(frozen=True)
class OrbaxStep:
  """An orbax step as jaxckpt reads it, nothing copied: its leaves (LeafInfo by jaxckpt
  path), a source per array leaf (``source[index]`` reads that region of orbax's array,
  opened on first read), the metadata a jaxckpt step of it carries (``custom_metadata``,
  time, metrics, the item kinds) and its items' kinds (one item, or a Composite)."""

  step: int | None
  leaves: dict[str, man.LeafInfo]
  sources: dict[str, Any]
  metadata: dict[str, Any]
  kinds: dict[str, str]
  single: bool


def open_orbax_step(step_dir: str, step: int, *, layout: str = "auto") -> OrbaxStep:
  """One finalized step directory of an orbax CheckpointManager, read where it lies: every
  item import_orbax reads (pytree, JSON, array, Grain), at the paths and with the metadata
  an import of it would write (``layout`` as :func:`import_orbax`'s)."""
  check_layout(layout)
  items, step_meta = step_dir_items(step_dir)
  return read_source(_pick(step, items, step_meta, None, step_dir), step_dir, None, layout)


def read_source(source: _Source, where: str, progress: Any, layout: str) -> OrbaxStep:
  """The leaves, sources and metadata of the ``source`` items (see :class:`OrbaxStep`)."""
  leaves, sources = {}, {}
  for name, (kind, item_dir, _) in source.items.items():
    prefix = "" if source.single else f"[{name!r}]"
    got, src = _ITEM_READERS[kind](item_dir, prefix, progress, layout)
    leaves.update(got)
    sources.update(src)
  if not leaves:
    raise errors.ManifestError(
        f"orbax checkpoint {where!r} holds no leaves that import_orbax can read (orbax's "
        "metadata gives an empty tree); point it at a StandardSave / StandardCheckpointer "
        "save (the directory with _METADATA, or the CheckpointManager directory)")
  kinds = {n: kind for n, (kind, _, _) in source.items.items()}
  metadata = _step_metadata(source)
  if source.single:
    if (kind := next(iter(kinds.values()))) != "pytree":
      metadata[_saved_items.ITEM_KEY] = kind
  else:
    metadata[_saved_items.ITEMS_KEY] = kinds
  return OrbaxStep(source.step, leaves, sources, metadata, kinds, source.single)


def _step_metadata(source: _Source) -> dict[str, Any]:
  """What orbax's manager kept of the step, as a jaxckpt manager keeps it: the
  ``custom_metadata`` given to ``save()``, its time and its metrics (``best_fn`` ranks by
  them; a time-based preservation policy reads the time)."""
  meta = source.step_meta
  out = dict(meta.get("custom_metadata") or {})
  nsecs = meta.get("commit_timestamp_nsecs") or meta.get("init_timestamp_nsecs")
  if nsecs:
    out[_saved_items.TIME_KEY] = nsecs / 1e9
  if source.metrics_dir is not None:
    out[_saved_items.METRICS_KEY] = _json_value(source.metrics_dir)
  return out


def _pytree_item(item_dir: str, prefix: str, progress: Any, layout: str
                 ) -> tuple[dict[str, man.LeafInfo], dict[str, Any]]:
  """A StandardSave / PyTreeSave item's leaves (at NNX paths as ``layout`` says)."""
  import jax  # pylint: disable=import-outside-toplevel
  tree, use_zarr3 = orbax_tree(item_dir)
  key_impls = orbax_key_impls(item_dir)
  leaves, sources = {}, {}
  for key_path, md in jax.tree_util.tree_flatten_with_path(tree)[0]:
    path = jax.tree_util.keystr(key_path)
    impl = (key_impls or {}).get(getattr(md, "name", None))
    leaves[path], src = _leaf_from(path, md, item_dir, use_zarr3, impl, progress)
    if src is not None:
      sources[path] = src
  if layout != "plain":
    new = ({p: nnx_path(p) for p in leaves} if layout == "nnx" else nnx_paths(list(leaves)))
    if any(new[p] != p for p in leaves):
      log.info("%s: a Flax NNX layout: its leaves are taken at their NNX paths", item_dir)   # (read or imported)
    leaves = {new[p]: (_nnx_leaf(p, new[p], info, key_impls is None) if new[p] != p else info)
              for p, info in leaves.items()}
    sources = {new[p]: src for p, src in sources.items()}
  return ({prefix + p: dataclasses.replace(i, path=prefix + p) for p, i in leaves.items()},
          {prefix + p: src for p, src in sources.items()})


def _json_item(item_dir: str, prefix: str, progress: Any, layout: str
               ) -> tuple[dict[str, man.LeafInfo], dict[str, Any]]:
  """A JsonSave item: its JSON text, one string leaf."""
  del progress, layout
  text = json.dumps(_json_value(item_dir))
  return {prefix: man.LeafInfo(path=prefix, kind="scalar", value=text)}, {}


def _json_value(item_dir: str) -> Any:
  """The value a JsonSave item holds (its one JSON file)."""
  files = [n for n in os.listdir(item_dir) if not n.startswith(".") and n != "commit_success.txt"
           and os.path.isfile(os.path.join(item_dir, n))]
  if len(files) != 1:
    raise errors.ManifestError(f"orbax JSON item {item_dir!r} holds files {sorted(files)}, "
                               "not one JSON file")
  with open(os.path.join(item_dir, files[0]), encoding="utf-8") as f:
    return json.load(f)


def _array_item(item_dir: str, prefix: str, progress: Any, layout: str
                ) -> tuple[dict[str, man.LeafInfo], dict[str, Any]]:
  """An ArraySave item: its one array."""
  del layout
  zarr3 = os.path.exists(os.path.join(item_dir, "checkpoint", "zarr.json"))
  view = _open_orbax_array(item_dir, "checkpoint", zarr3)
  info = man.LeafInfo(path=prefix, kind="numpy", shape=tuple(view.shape),
                      dtype=np.dtype(view.dtype.numpy_dtype).name)
  return {prefix: info}, {prefix: _Counted(item_dir, "checkpoint", zarr3, progress, view=view)}


def _grain_item(item_dir: str, prefix: str, progress: Any, layout: str
                ) -> tuple[dict[str, man.LeafInfo], dict[str, Any]]:
  """A Grain iterator's state: one row per process that saved it (as the manager saves it)."""
  del progress, layout
  files = {}
  for f in glob.glob(os.path.join(item_dir, "process_*-of-*.json")):
    m = re.fullmatch(r"process_(\d+)-of-(\d+)\.json", os.path.basename(f))
    if m:
      files[int(m.group(1))] = (int(m.group(2)), f)
  count = {n for n, _ in files.values()}
  if len(count) != 1 or sorted(files) != list(range(next(iter(count)))):
    raise errors.ManifestError(f"orbax Grain item {item_dir!r} does not hold one state per "
                               f"process (files of processes {sorted(files)})")
  rows = np.concatenate([_saved_items.encode_row(open(files[i][1], "rb").read(), item_dir)[None]
                         for i in sorted(files)])
  info = man.LeafInfo(path=prefix, kind="numpy", shape=rows.shape, dtype="uint8")
  return {prefix: info}, {prefix: rows}


_ITEM_READERS = {"pytree": _pytree_item, "json": _json_item, "array": _array_item,
                 "grain": _grain_item}
