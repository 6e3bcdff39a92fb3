"""Train torchvision resnet18 on MNIST with the `int8_sparse24` recipe: python recipes/examples/train_int8_sparse24.py --help"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run  # noqa: E402

if __name__ == "__main__":
    run("int8_sparse24", "resnet18")
