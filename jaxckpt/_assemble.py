"""Build jax.Arrays on a target sharding from any source of regions.

One code path for every tier: the host snapshot, parity-decoded pieces and the
universal format on storage all hand in a ``read_region(box) -> np.ndarray``;
this module asks it only for the boxes that this process's devices hold, each
distinct box once (replicated devices share one read).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jaxckpt.snapshot import Box, aligned_copy, box_from_index


def device_boxes(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict:
  """Maps each addressable device of ``sharding`` to the box of ``shape`` it holds."""
  return {d: box_from_index(idx, shape)
          for d, idx in sharding.addressable_devices_indices_map(shape).items()}


def make_array(shape: tuple[int, ...], dtype: np.dtype,
               sharding: jax.sharding.Sharding,
               read_region: Callable[[Box], np.ndarray]) -> jax.Array:
  """A jax.Array of ``shape`` on ``sharding`` whose values come from ``read_region``.

  ``read_region`` must return a fresh array (never a view of memory that is
  reused later): XLA:CPU keeps an aligned host buffer given to ``device_put``
  instead of copying it. For the same reason each device gets its own host
  array: a box held by several devices is read once and copied for the others.
  """
  boxes = device_boxes(shape, sharding)
  read: dict[Box, np.ndarray] = {}
  hosts = []
  for box in boxes.values():
    if box in read:
      host = aligned_copy(read[box])
    else:
      host = read[box] = np.asarray(read_region(box), dtype=dtype)
    hosts.append(host)
  arrays = jax.device_put(hosts, list(boxes))        # one batched transfer
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
