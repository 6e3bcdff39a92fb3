"""dal.ptq tests: one thread (the machine is shared; thread oversubscription made them 10x slower)."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
