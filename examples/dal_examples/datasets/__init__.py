"""Small real data sets that ship inside wheels (no download at run time)."""
from .cluttered import cluttered_mnist_loaders, load_cluttered_mnist
from .digits import digits_loaders
from .mnist import load_mnist, mnist_loaders
from .mnist_scenes import Scenes, mnist_scenes

__all__ = ["load_mnist", "mnist_loaders", "digits_loaders", "load_cluttered_mnist", "cluttered_mnist_loaders",
           "mnist_scenes", "Scenes"]
