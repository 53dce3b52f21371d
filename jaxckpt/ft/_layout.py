"""What the members of an all-reduce agree on besides the step: the gradients' layout.

The ring averages flat buffers, so two members whose gradients differ in tree
structure, shapes or dtypes but not in total size would silently average
unrelated numbers (``{"a": f32[8]}`` with ``{"a": f32[4], "b": f32[4]}``). Each
ring piece therefore carries its sender's :class:`Layout` (three short digests
and a short description), and a receiver refuses a piece whose layout is not its
own, naming the sender and what differs (:func:`mismatch`).

>>> import numpy as np, jax
>>> a = of(*jax.tree_util.tree_flatten({"a": np.zeros(8, np.float32)})[::-1])
>>> b = of(*jax.tree_util.tree_flatten({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)})[::-1])
>>> a.description
"{'a': float32[8]}"
>>> print(mismatch("g1", b.to_wire(), a, "g0"))
group g1 averages {'a': float32[4], 'b': float32[4]} where group g0 averages {'a': float32[8]}: they differ in tree structure (g1 has 2 leaves, g0 1 leaf)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np
import xxhash

_MAX_DESCRIPTION = 200


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
  """Digests of a gradient's tree structure, leaf shapes and leaf dtypes, and a description."""
  tree: int
  shapes: int
  dtypes: int
  leaves: int
  description: str

  def to_wire(self) -> list[Any]:
    return [self.tree, self.shapes, self.dtypes, self.leaves, self.description]


def of(treedef: Any, leaves: Sequence[Any]) -> Layout:
  """The layout of the gradient ``treedef`` over ``leaves`` (arrays or ShapeDtypeStructs)."""
  shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
  dtypes = tuple(np.dtype(x.dtype).name for x in leaves)
  return _layout(treedef, shapes, dtypes)


@functools.lru_cache(maxsize=16)
def _layout(treedef: Any, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]) -> Layout:
  tree = str(treedef)
  return Layout(tree=_digest(tree), shapes=_digest(repr(shapes)), dtypes=_digest(repr(dtypes)),
                leaves=len(shapes), description=_describe(tree, shapes, dtypes))


def mismatch(sender: str, theirs: Any, mine: Layout | Sequence[Any], me: str) -> str | None:
  """Why ``sender``'s piece, of layout ``theirs`` (the wire form, from its header),
  cannot be averaged with this member's (``me``, of layout ``mine``); None if the
  layouts agree."""
  if not isinstance(mine, Layout):
    mine = Layout(*mine)
  if not isinstance(theirs, (list, tuple)) or len(theirs) != 5:
    return f"group {sender} sent no gradient layout that group {me} can compare with its own"
  tree, shapes, dtypes, leaves, description = theirs
  if (tree, shapes, dtypes) == (mine.tree, mine.shapes, mine.dtypes):
    return None
  if leaves != mine.leaves:
    what = f"tree structure ({sender} has {_leaves(leaves)}, {me} {_leaves(mine.leaves)})"
  else:
    differ = [name for name, a, b in (("tree structure", tree, mine.tree), ("shapes", shapes, mine.shapes),
                                      ("dtypes", dtypes, mine.dtypes)) if a != b]
    what = differ[0] if len(differ) == 1 else ", ".join(differ[:-1]) + " and " + differ[-1]
  return (f"group {sender} averages {description} where group {me} averages {mine.description}: "
          f"they differ in {what}")


def _leaves(n: int) -> str:
  return f"{n} leaf" if n == 1 else f"{n} leaves"


def _digest(text: str) -> int:
  return xxhash.xxh3_64_intdigest(text.encode())


def _describe(tree: str, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]) -> str:
  """``tree`` (``PyTreeDef(...)``) with each leaf written as ``dtype[shape]``, cut short if long."""
  body = tree[len("PyTreeDef("):-1] if tree.startswith("PyTreeDef(") else tree
  parts, out, leaf = body.split("*"), [], 0
  for i, part in enumerate(parts):
    out.append(part)
    if i < len(parts) - 1 and leaf < len(shapes):
      out.append(f"{dtypes[leaf]}[{','.join(map(str, shapes[leaf]))}]")
      leaf += 1
    if sum(map(len, out)) > _MAX_DESCRIPTION:
      break
  text = "".join(out)
  if len(text) > _MAX_DESCRIPTION or leaf < len(shapes):
    text = text[:_MAX_DESCRIPTION] + f"... ({len(shapes)} leaves)"
  return text
