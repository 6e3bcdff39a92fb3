"""Shared fixtures: one C++ build per worker (cached on disk by torch, locked across workers)
and one directory of test models shared by all xdist workers."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def npu_lib():
    from dal.npu.build import kernels
    return kernels()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    # the parent of a worker's basetemp is shared by all xdist workers of this run
    d = tmp_path_factory.getbasetemp().parent / "npu_models"
    d.mkdir(exist_ok=True)
    return str(d)
