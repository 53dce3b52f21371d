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

from jaxckpt.host.snapshot import Box, box_from_index


def device_boxes(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict:
  """Maps each addressable device of ``sharding`` to the box of ``shape`` it holds."""
  return {d: box_from_index(idx, shape)
          for d, idx in sharding.addressable_devices_indices_map(shape).items()}


def make_array(shape: tuple[int, ...], dtype: np.dtype,
               sharding: jax.sharding.Sharding,
               read_region: Callable[[Box], np.ndarray]) -> jax.Array:
  """A jax.Array of ``shape`` on ``sharding`` whose values come from ``read_region``.

  Each distinct box is read once. ``read_region`` must return memory that is
  never written again when the devices are CPUs: XLA:CPU keeps (adopts) an
  aligned host buffer given to ``device_put`` instead of copying it, and
  devices that hold the same box share that one buffer. This is safe because
  XLA:CPU never donates an adopted buffer in place (a donating computation
  writes a new buffer; pinned by ``manager_test.py``).
  """
  boxes = device_boxes(shape, sharding)
  read: dict[Box, np.ndarray] = {}
  hosts = []
  for box in boxes.values():
    host = read.get(box)
    if host is None:
      host = read[box] = np.asarray(read_region(box), dtype=dtype)
    hosts.append(host)
  arrays = jax.device_put(hosts, list(boxes))        # one batched transfer
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
