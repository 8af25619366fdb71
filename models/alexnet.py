"""AlexNet with BatchNormalization (AlexNet-BN) as a plain Keras functional model.

Single-tower AlexNet (no grouped convolutions, no local response normalisation)
with BatchNormalization after every convolution and after pool5: the AlexNet-BN
variant Jia et al. 2018 use for their large-batch (64K) AlexNet runs.

References:
    - Krizhevsky, Sutskever, Hinton 2012, "ImageNet Classification with Deep
      Convolutional Neural Networks", NeurIPS 2012.
    - Jia et al. 2018, "Highly Scalable Deep Learning Training System with
      Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205
      (AlexNet with BN, BN added after pool5).

``alexnet_bn_small`` is the same design in miniature (two conv-BN-ReLU-pool
blocks, BN after the last pool, two dense layers) for 8x8 images such as
scikit-learn's digits: the model of the large-batch study
(launch/studies/large_batch/).
"""

import keras

from tfscale.models import _common

# (name, filters, kernel, strides, padding, max pool 3/2 after it?)
_CONVS = (
    ("conv1", 96, 11, 4, "valid", True),
    ("conv2", 256, 5, 1, "same", True),
    ("conv3", 384, 3, 1, "same", False),
    ("conv4", 384, 3, 1, "same", False),
    ("conv5", 256, 3, 1, "same", True),
)
_POOL_SIZE = 3
_POOL_STRIDES = 2
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5

# alexnet_bn_small: two 3x3 "same" convolutions, each followed by a 2x2/2 max
# pool, so height and width must be at least 4 for pool2 to be at least 1x1.
_SMALL_POOL_SIZE = 2
_SMALL_MIN_INPUT_SIZE = _SMALL_POOL_SIZE**2
# alexnet_bn_small's BatchNormalization keeps Keras's default epsilon, 1e-3
# (not _bn's 1e-5): docs/large_batch.md was measured with it. Its momentum is
# _BN_MOMENTUM: Keras's default, 0.99, leaves the moving statistics half at
# their initial values after the few dozen steps of a large-batch run,
# and the test accuracy then measures that lag, not the weights.
_SMALL_BN_EPSILON = 1e-3


def _output_size(size):
    """Spatial size after the conv/pool stack, or 0 if a pool sees less than 3x3."""
    for _, _, kernel, strides, padding, pool in _CONVS:
        if padding == "valid":
            if size < kernel:
                return 0
            size = (size - kernel) // strides + 1
        if pool:
            if size < _POOL_SIZE:
                return 0
            size = (size - _POOL_SIZE) // _POOL_STRIDES + 1
    return size


def _min_input_size():
    """Smallest height/width for which pool5 has at least 1x1 spatial extent."""
    size = 1
    while _output_size(size) < 1:
        size += 1
    return size


def _bn(name):
    return keras.layers.BatchNormalization(
        axis=-1, momentum=_BN_MOMENTUM, epsilon=_BN_EPSILON, name=name
    )


def alexnet_bn(
    num_classes=1000, input_shape=(227, 227, 3), fc_units=4096, dropout=0.5
):
    """Builds AlexNet-BN returning logits.

    Layers at the default 227x227x3 input and 1000 classes (BN rows: trainable
    gamma/beta + non-trainable moving mean/variance; convolutions have no bias,
    BN's beta replaces it)::

        layer                          output shape     parameters
        conv1 96 11x11/4 valid         55 x 55 x 96         34,848
        conv1_bn, ReLU                 55 x 55 x 96      192 + 192
        pool1 max 3x3/2                27 x 27 x 96              0
        conv2 256 5x5 same             27 x 27 x 256       614,400
        conv2_bn, ReLU                 27 x 27 x 256     512 + 512
        pool2 max 3x3/2                13 x 13 x 256             0
        conv3 384 3x3 same             13 x 13 x 384       884,736
        conv3_bn, ReLU                 13 x 13 x 384     768 + 768
        conv4 384 3x3 same             13 x 13 x 384     1,327,104
        conv4_bn, ReLU                 13 x 13 x 384     768 + 768
        conv5 256 3x3 same             13 x 13 x 256       884,736
        conv5_bn, ReLU                 13 x 13 x 256     512 + 512
        pool5 max 3x3/2                 6 x  6 x 256             0
        pool5_bn (Jia et al. 2018)      6 x  6 x 256     512 + 512
        flatten                              9,216               0
        fc6 4096, ReLU, dropout              4,096      37,752,832
        fc7 4096, ReLU, dropout              4,096      16,781,312
        fc8 1000 (logits)                    1,000       4,097,000
        total: 62,380,232 trainable + 3,264 non-trainable = 62,383,496

    The size depends on the input: at 224x224 pool5 is 5x5, fc6 has
    26,218,496 parameters and the model 50,845,896 trainable ones (203.4 MB
    of float32 gradients, against 249.5 MB at 227x227). The smallest input is
    67x67 (pool5 then has 1x1 spatial extent); at 96x96
    pool5 is also 1x1, which with a small ``fc_units`` makes a fast test model.

    There is no weight decay in the model: the optimizer applies it (and skips
    BN parameters, whose paths contain "bn", and biases, whose paths end in
    "bias"). Under a mixed-precision global policy the layers compute in half
    precision, variables stay float32 and the logits are float32.

    Args:
        num_classes: Number of output logits.
        input_shape: ``(height, width, channels)``; any channel count works,
            e.g. 1 for grayscale.
        fc_units: Width of fc6 and fc7.
        dropout: Dropout rate after fc6 and fc7, in [0, 1).

    Returns:
        An uncompiled ``keras.Model`` named "alexnet_bn" mapping images to
        float32 logits of shape (batch, num_classes); no softmax.

    Raises:
        ValueError: If an argument is invalid, including an ``input_shape`` too
            small for pool5 to have any spatial extent.

    References:
        - Krizhevsky et al. 2012, NeurIPS 2012.
        - Jia et al. 2018, arXiv:1807.11205.
    """
    _common.check_positive_int("num_classes", num_classes)
    _common.check_positive_int("fc_units", fc_units)
    input_shape = _common.check_input_shape(input_shape)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
        0 <= dropout < 1
    ):
        raise ValueError(
            f"`dropout` must be a number in [0, 1). Received: dropout={dropout!r}"
        )
    height, width, _ = input_shape
    if _output_size(height) < 1 or _output_size(width) < 1:
        min_size = _min_input_size()
        raise ValueError(
            "`input_shape` is too small: pool5 would have no spatial extent. "
            f"Height and width must be at least {min_size}. "
            f"Received: input_shape={input_shape!r}"
        )

    inputs = keras.Input(shape=input_shape, name="images")
    x = inputs
    for name, filters, kernel, strides, padding, pool in _CONVS:
        x = keras.layers.Conv2D(
            filters,
            kernel,
            strides=strides,
            padding=padding,
            use_bias=False,  # BN's beta replaces the bias.
            kernel_initializer="he_normal",
            data_format=_common.DATA_FORMAT,
            name=name,
        )(x)
        x = _bn(f"{name}_bn")(x)
        x = keras.layers.ReLU(name=f"{name}_relu")(x)
        if pool:
            x = keras.layers.MaxPooling2D(
                _POOL_SIZE,
                strides=_POOL_STRIDES,
                data_format=_common.DATA_FORMAT,
                name=f"pool{name[-1]}",
            )(x)
    # The extra BN of Jia et al. 2018: normalises fc6's input at large batch.
    x = _bn("pool5_bn")(x)
    x = keras.layers.Flatten(data_format=_common.DATA_FORMAT, name="flatten")(x)
    for name in ("fc6", "fc7"):
        x = keras.layers.Dense(
            fc_units, activation="relu", kernel_initializer="he_normal", name=name
        )(x)
        x = keras.layers.Dropout(dropout, name=f"{name}_dropout")(x)
    outputs = _common.logits_head(x, num_classes, name="fc8")
    return keras.Model(inputs, outputs, name="alexnet_bn")


def alexnet_bn_small(num_classes=10, input_shape=(8, 8, 1), width=32, fc_units=64,
                     synchronized_batch_norm=False):
    """Builds AlexNet-BN in miniature for small images, returning logits.

    Two conv-BN-ReLU-pool blocks, BatchNormalization after the last pool (Jia
    et al. 2018's change to AlexNet-BN) and two dense layers: the model of the
    large-batch study on Fashion-MNIST (width 8, at the images' own 28x28),
    where ``alexnet_bn`` (67x67 at the smallest) would train for hours. Layers at the default 8x8x1 input, ``width`` 32,
    ``fc_units`` 64 and 10 classes (BN rows: trainable gamma/beta +
    non-trainable moving mean/variance; convolutions have no bias, BN's beta
    replaces it)::

        layer                          output shape     parameters
        conv1 32 3x3 same               8 x  8 x 32            288
        conv1_bn, ReLU                  8 x  8 x 32        64 + 64
        pool1 max 2x2/2                 4 x  4 x 32              0
        conv2 64 3x3 same               4 x  4 x 64         18,432
        conv2_bn, ReLU                  4 x  4 x 64      128 + 128
        pool2 max 2x2/2                 2 x  2 x 64              0
        pool_bn (Jia et al. 2018)       2 x  2 x 64      128 + 128
        flatten                                256               0
        fc1 64, ReLU                            64          16,448
        fc2 10 (logits, float32)                10             650
        total: 36,138 trainable + 320 non-trainable = 36,458

    BatchNormalization uses momentum 0.9, as ``alexnet_bn``, but Keras's
    default epsilon 1e-3 (``alexnet_bn``: 1e-5), the setting the study's
    results were measured with. Convolutions and fc1 start He-normal, fc2
    Glorot-uniform; there is no dropout.

    There is no weight decay in the model: the optimizer applies it (and skips
    BN parameters, whose paths contain "bn", and biases, whose paths end in
    "bias"). Under a mixed-precision global policy the layers compute in half
    precision except fc2, which computes in float32 (a stable softmax);
    variables stay float32.

    Args:
        num_classes: Number of output logits.
        input_shape: ``(height, width, channels)``; height and width at least
            4 (pool2 then has 1x1 spatial extent), any channel count.
        width: Filters of conv1; conv2 has twice as many.
        fc_units: Width of fc1.
        synchronized_batch_norm: BatchNormalization over the global batch
            (Keras's ``synchronized=True``: statistics all-reduced across
            workers), so that N workers train as one worker with the same
            global batch.

    Returns:
        An uncompiled ``keras.Model`` named "alexnet_bn_small" mapping images
        to float32 logits of shape (batch, num_classes); no softmax.

    Raises:
        ValueError: If an argument is invalid, including an ``input_shape`` too
            small for pool2 to have any spatial extent.

    References:
        - Krizhevsky et al. 2012, NeurIPS 2012.
        - Jia et al. 2018, arXiv:1807.11205.
    """
    _common.check_positive_int("num_classes", num_classes)
    _common.check_positive_int("width", width)
    _common.check_positive_int("fc_units", fc_units)
    input_shape = _common.check_input_shape(input_shape)
    if min(input_shape[:2]) < _SMALL_MIN_INPUT_SIZE:
        raise ValueError(
            "`input_shape` is too small: pool2 would have no spatial extent. "
            f"Height and width must be at least {_SMALL_MIN_INPUT_SIZE}. "
            f"Received: input_shape={input_shape!r}"
        )

    inputs = keras.Input(shape=input_shape, name="images")
    x = inputs
    for index, filters in enumerate((width, 2 * width), start=1):
        x = keras.layers.Conv2D(
            filters,
            3,
            padding="same",
            use_bias=False,  # BN's beta replaces the bias.
            kernel_initializer="he_normal",
            data_format=_common.DATA_FORMAT,
            name=f"conv{index}",
        )(x)
        x = keras.layers.BatchNormalization(
            momentum=_BN_MOMENTUM, epsilon=_SMALL_BN_EPSILON,
            synchronized=synchronized_batch_norm, name=f"conv{index}_bn"
        )(x)
        x = keras.layers.ReLU(name=f"conv{index}_relu")(x)
        x = keras.layers.MaxPooling2D(
            _SMALL_POOL_SIZE, data_format=_common.DATA_FORMAT, name=f"pool{index}"
        )(x)
    # The extra BN of Jia et al. 2018, after the last pool.
    x = keras.layers.BatchNormalization(
        momentum=_BN_MOMENTUM, epsilon=_SMALL_BN_EPSILON,
        synchronized=synchronized_batch_norm, name="pool_bn"
    )(x)
    x = keras.layers.Flatten(data_format=_common.DATA_FORMAT, name="flatten")(x)
    x = keras.layers.Dense(
        fc_units, activation="relu", kernel_initializer="he_normal", name="fc1"
    )(x)
    # float32 logits under mixed precision: a stable softmax.
    outputs = keras.layers.Dense(num_classes, dtype="float32", name="fc2")(x)
    return keras.Model(inputs, outputs, name="alexnet_bn_small")
