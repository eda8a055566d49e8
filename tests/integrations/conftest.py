"""Fixtures of the integration tests."""

import pytest

from vmstoolkit.integrations.native_torch import NativeHook
from vmstoolkit.pools.drivers.sim import SimulatedDriver
from vmstoolkit.units import GiB


@pytest.fixture
def hook():
    """The compiled ``paged`` hook on a simulated 4 GiB device, given back after the test."""
    h = NativeHook(lambda device: SimulatedDriver(capacity=4 * GiB))
    yield h
    h.close()
