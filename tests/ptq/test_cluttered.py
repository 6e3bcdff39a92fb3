"""Cluttered MNIST (dal_examples.datasets.cluttered): deterministic, fixed split, harder than MNIST."""
import torch

from dal_examples.datasets import load_cluttered_mnist, load_mnist
from dal_examples.datasets import cluttered as C


def test_deterministic_and_fixed_split():
    x, y = load_cluttered_mnist("valid")
    assert x.shape == (10000, 1, 28, 28) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert torch.equal(y, load_mnist()["valid"][1])  # MNIST's labels, same order
    C._CACHE.pop("valid")
    again, _ = load_cluttered_mnist("valid")
    assert torch.equal(x, again)  # rebuilt from scratch: the same tensors
    assert not torch.equal(x, load_mnist()["valid"][0])


def test_every_image_is_distorted():
    x, _ = load_cluttered_mnist("valid")
    plain = load_mnist()["valid"][0]
    # Noise and clutter touch most pixels; an undistorted image would differ by 0.
    diff = (x - plain).abs().flatten(1).mean(1)
    assert float(diff.min()) > 0.02


def test_bad_split_names_the_choices():
    import pytest

    with pytest.raises(ValueError, match="'train'"):
        load_cluttered_mnist("training")
