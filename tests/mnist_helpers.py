"""Helpers: a briefly trained MNIST CNN (5k images, 1 epoch), shared by the calibration and analysis tests."""
import copy

import torch

W4A8 = {"name": "w4a8_test", "rules": [
    {"type": ["conv", "linear"],
     "weight": {"format": "int4", "granularity": "per_channel", "symmetric": True, "observer": "minmax"},
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "moving_average"}},
    {"type": ["add", "pool"],
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "moving_average"}}]}


def trained_mnist():
    """(float model, calibration batches [(x, y)] of 32, test batches [(x, y)] of 256)."""
    from dal_examples.datasets import mnist_loaders
    from dal_examples.training import train_epoch
    from dal_examples.zoo import MnistCNN

    torch.manual_seed(0)
    train, _ = mnist_loaders(batch_size=64, train_limit=5000)
    model = MnistCNN()
    train_epoch(model, train, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model.eval()
    from dal_examples.datasets import load_mnist

    x, y = load_mnist()["valid"]
    x = (x - 0.1307) / 0.3081
    calib = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)]
    test = [(x[i:i + 256], y[i:i + 256]) for i in range(1024, 2048, 256)]
    return model, calib, test


def prepared(model, recipe=W4A8, example=None):
    import dal

    x = example if example is not None else torch.zeros(2, 1, 28, 28)
    return dal.prepare_qat(copy.deepcopy(model), recipe=recipe, hardware="a2000",
                           example_inputs=(x,), quantize_outputs=True)


def accuracy(model, batches) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in batches)
    return 100.0 * correct / sum(len(y) for _, y in batches)
