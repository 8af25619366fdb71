"""The model `tfscale-bench train` times, built alike on either backend."""

from tfscale import models


def build(spec):
    """`spec["model"]` at `spec["image_size"]`, 1000 classes.

    AlexNet-BN trains without dropout here: its random masks differ between
    TensorFlow and JAX, and train.py compares the two backends' losses step
    for step. A mask costs one multiply per activation of fc6 and fc7.
    """
    size = spec["image_size"]
    options = {}
    if spec["model"] == "alexnet_bn":
        options = {"fc_units": spec["fc_units"], "dropout": 0.0}
    return models.get(spec["model"], num_classes=1000, input_shape=(size, size, 3),
                      **options)
