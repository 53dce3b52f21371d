"""The snapshot scenarios on real TPUs (run on a TPU VM: python -m pytest tpu_tests)."""

import pytest

from jaxckpt.testing import scenarios

DEVICES = scenarios.platform_devices("tpu")

pytestmark = pytest.mark.skipif(not DEVICES, reason="needs a TPU: jax found no 'tpu' backend")


@pytest.mark.parametrize("name", scenarios.NAMES)
def test_scenario(name):
  scenarios.run(name, DEVICES)
