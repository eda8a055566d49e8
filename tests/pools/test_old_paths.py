"""Module paths from before the pools/ tree was split keep working (issue 19)."""

import importlib

import pytest

import vmstoolkit.pools as pools


@pytest.mark.parametrize("old,new", sorted(pools._MOVED.items()))
def test_an_old_module_path_is_the_new_module(old, new):
    assert importlib.import_module(f"vmstoolkit.pools.{old}") is importlib.import_module(f"vmstoolkit.pools.{new}")


def test_names_users_imported_from_old_paths_resolve():
    from vmstoolkit.pools.sim_driver import SimulatedDriver
    from vmstoolkit.pools.vmm_allocator import VMMAllocator

    assert SimulatedDriver is pools.SimulatedDriver
    assert VMMAllocator.__module__ == "vmstoolkit.pools.vmm.allocator"
