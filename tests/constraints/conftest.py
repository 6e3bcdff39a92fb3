"""Session fixture of the hardware-constraint tests (helpers: constraints_common.py)."""
import pytest


@pytest.fixture(scope="session")
def npu_lib():
    from dal.npu.build import kernels
    return kernels()
