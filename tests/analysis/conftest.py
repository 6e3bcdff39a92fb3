"""Session fixture: the briefly trained MNIST CNN of analysis_helpers.py."""
import pytest

from mnist_helpers import trained_mnist


@pytest.fixture(scope="session")
def mnist():
    return trained_mnist()
