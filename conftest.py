"""Root pytest configuration: 8 CPU devices before JAX starts, or fail."""

import jax

jax.config.update("jax_num_cpu_devices", 8)


def pytest_sessionstart(session):
  del session
  n = len(jax.devices("cpu"))
  if n != 8:
    raise RuntimeError(
        f"conftest.py wanted 8 CPU devices but JAX has {n}: something started "
        "the JAX backend before conftest.py ran (a plugin or a sitecustomize?). "
        "Run pytest from the repository root.")
