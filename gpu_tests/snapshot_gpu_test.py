"""The snapshot scenarios on real GPUs (run on a GPU machine: python -m pytest gpu_tests)."""

import pytest

from jaxckpt.testing import scenarios

DEVICES = scenarios.platform_devices("gpu")

pytestmark = pytest.mark.skipif(not DEVICES, reason="needs a CUDA GPU: jax found no 'gpu' backend")


@pytest.mark.parametrize("name", scenarios.NAMES)
def test_scenario(name):
  scenarios.run(name, DEVICES)
