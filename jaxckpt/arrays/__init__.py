"""Host bytes -> jax.Arrays: each array built on its target sharding from the regions its
devices hold (``_assemble``), one path for every reader (a restore from host memory, parity
or storage, a replica group's catch-up).

Below both ``restore`` and ``universal`` (it imports only ``host.snapshot`` and JAX), so
either reads arrays through it.
"""
