"""The shipped platform scenarios, on the 8 emulated CPU devices."""

import jax
import pytest

from jaxckpt.testing import scenarios


@pytest.mark.parametrize("name", scenarios.NAMES)
def test_scenario(name):
  scenarios.run(name, jax.devices("cpu"))
