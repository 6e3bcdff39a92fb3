"""MNIST scenes: deterministic, and boxes / masks that agree with the strokes in the image.

The checks read the pixels with numpy, not the generator's bookkeeping: a stroke pixel is an
image pixel > 0.5 (the image is the pixel-wise max of the pasted digits, so it is > 0.5 exactly
where some digit's stroke is), a box is tight when each of its four edges has a stroke pixel
just inside it.
"""
import numpy as np
import pytest
import torch

from dal_examples.datasets.mnist_scenes import STROKE, mnist_scenes


@pytest.fixture(scope="module")
def scenes():
    return mnist_scenes("test", 60, size=96, seed=3)


def test_same_arguments_same_scenes(scenes):
    again = mnist_scenes("test", 60, size=96, seed=3)
    assert torch.equal(scenes.images, again.images) and torch.equal(scenes.masks, again.masks)
    assert all(torch.equal(a, b) for a, b in zip(scenes.boxes, again.boxes))
    assert all(torch.equal(a, b) for a, b in zip(scenes.labels, again.labels))
    other = mnist_scenes("test", 60, size=96, seed=4)
    assert not torch.equal(scenes.images, other.images)


def test_train_and_test_scenes_use_disjoint_digit_images():
    from dal_examples.datasets import load_mnist

    train = mnist_scenes("train", 5, seed=3)
    test = mnist_scenes("test", 5, seed=3)
    assert not torch.equal(train.images, test.images)
    assert load_mnist()["train"][0].shape[0] == 50000 and load_mnist()["test"][0].shape[0] == 10000


def test_one_to_four_digits_ten_classes(scenes):
    counts = [len(b) for b in scenes.boxes]
    assert min(counts) >= 1 and max(counts) <= 4 and len(set(counts)) >= 3
    labels = torch.cat(scenes.labels)
    assert labels.min() >= 0 and labels.max() <= 9 and len(labels.unique()) == 10


def test_mask_is_exactly_the_stroke_pixels(scenes):
    img = scenes.images[:, 0].numpy()
    np.testing.assert_array_equal(scenes.masks.numpy() > 0, img > STROKE)
    np.testing.assert_array_equal(scenes.instances.numpy() > 0, img > STROKE)


def test_boxes_are_tight_around_their_strokes(scenes):
    img = scenes.images[:, 0].numpy() > STROKE
    inst, masks = scenes.instances.numpy(), scenes.masks.numpy()
    for i, (boxes, labels) in enumerate(zip(scenes.boxes, scenes.labels)):
        for k, ((x0, y0, x1, y1), c) in enumerate(zip(boxes.int().tolist(), labels.tolist())):
            assert 0 <= x0 < x1 <= 96 and 0 <= y0 < y1 <= 96
            own = inst[i] == k + 1
            assert own.any(), f"scene {i} digit {k} has no visible stroke"
            ys, xs = np.nonzero(own)
            # every visible pixel of the digit lies in its box, with its class in the mask
            assert x0 <= xs.min() and xs.max() < x1 and y0 <= ys.min() and ys.max() < y1
            assert (masks[i][own] == c + 1).all()
            # each edge has a stroke pixel just inside it (the image's, whoever is on top)
            crop = img[i, y0:y1, x0:x1]
            assert crop[0].any() and crop[-1].any() and crop[:, 0].any() and crop[:, -1].any()


def test_single_digit_box_is_the_bounding_box_of_the_bright_pixels():
    s = mnist_scenes("test", 40, seed=5, max_digits=1)
    for i in range(len(s)):
        ys, xs = np.nonzero(s.images[i, 0].numpy() > STROKE)
        expect = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        assert s.boxes[i].tolist() == [[float(v) for v in expect]]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="split='val'"):
        mnist_scenes("val", 2)
    with pytest.raises(ValueError, match="max_side=200"):
        mnist_scenes("test", 2, max_side=200)
