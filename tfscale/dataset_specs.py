"""The data sets tfscale knows, and what a model and an export need to know
about each. No TensorFlow here: tfscale-train checks --dataset with these
before it imports TensorFlow. `tfscale.data` builds their input pipelines and
re-exports `DatasetSpec`, `SPECS`, `names` and `spec`.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a model and an export need to know about a data set.

    Attributes:
        name: data set name.
        num_classes: number of labels.
        stored_shape: (height, width, channels) of one uint8 image as the
            data set stores it; None for sizes that vary (ImageNet).
        channels: image channels.
        default_image_size: side of the square model input.
        mean, std: per-channel normalization on the 0-255 scale.
    """

    name: str
    num_classes: int
    stored_shape: tuple | None
    channels: int
    default_image_size: int
    mean: tuple
    std: tuple


SPECS = {
    # digits: 67 is the smallest input with a non-empty AlexNet pool5.
    "digits": DatasetSpec("digits", 10, (8, 8, 1), 1, 67, (127.5,), (127.5,)),
    # Fashion-MNIST's training-set pixel mean and standard deviation
    # (tfscale.fashion_mnist_source; measured over the 60,000 images).
    # Upsampled to 67 for alexnet_bn, as digits.
    "fashion_mnist": DatasetSpec(
        "fashion_mnist", 10, (28, 28, 1), 1, 67, (72.94,), (90.02,)),
    "synthetic": DatasetSpec(
        "synthetic", 1000, None, 3, 224, (127.5,) * 3, (127.5,) * 3
    ),
    "imagenet": DatasetSpec(
        "imagenet", 1000, None, 3, 224,
        (123.675, 116.28, 103.53), (58.395, 57.12, 57.375),
    ),
}


def names():
    """The known data sets' names, sorted."""
    return sorted(SPECS)


def spec(name):
    """The `DatasetSpec` of `name`; a ValueError lists the known names."""
    if name not in SPECS:
        raise ValueError(
            f"Unknown data set: {name!r}. Known: {', '.join(names())}"
        )
    return SPECS[name]


# The split an evaluation reads, by data set (synthetic has none).
EVAL_SPLITS = {"digits": "test", "fashion_mnist": "test", "imagenet": "validation"}
