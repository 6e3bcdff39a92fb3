"""Train torchvision resnet18 on MNIST with the `w4a8_fp8_performance` recipe: python recipes/examples/train_w4a8_fp8_performance.py --help"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run  # noqa: E402

if __name__ == "__main__":
    run("w4a8_fp8_performance", "resnet18")
