"""Small real data sets that ship inside wheels (no download at run time)."""
from .digits import digits_loaders
from .mnist import load_mnist, mnist_loaders

__all__ = ["load_mnist", "mnist_loaders", "digits_loaders"]
