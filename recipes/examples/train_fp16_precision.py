"""Train torchvision mobilenet_v2 on MNIST with the `fp16_precision` recipe: python recipes/examples/train_fp16_precision.py --help"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run  # noqa: E402

if __name__ == "__main__":
    run("fp16_precision", "mobilenet_v2")
