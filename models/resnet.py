"""ResNet-50 v1.5 as a plain Keras functional model.

ResNet-50 (He et al. 2016) in the "v1.5" variant used by Goyal et al. 2017, the
MLPerf reference and Jia et al. 2018: in the first bottleneck block of a
downsampling stage the stride sits on the 3x3 convolution, not on the first 1x1.

References:
    - He et al. 2016, "Deep Residual Learning for Image Recognition",
      arXiv:1512.03385.
    - Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1
      Hour", arXiv:1706.02677 (zero-initialised last BN gamma, section 5.1).
    - Jia et al. 2018, "Highly Scalable Deep Learning Training System with
      Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

import keras

from tfscale.models import _common

# (stage name, blocks, bottleneck width, stride of the stage's first block).
_STAGES = (
    ("conv2", 3, 64, 1),
    ("conv3", 4, 128, 2),
    ("conv4", 6, 256, 2),
    ("conv5", 3, 512, 2),
)
_EXPANSION = 4


def _conv_bn(
    x,
    filters,
    kernel_size,
    strides,
    name,
    bn_momentum,
    bn_epsilon,
    relu=True,
    gamma_initializer="ones",
):
    """Conv (no bias) + BN (+ ReLU) named ``{name}_conv``/``_bn``/``_relu``.

    Strided convolutions with a kernel larger than 1 pad explicitly and
    symmetrically (``kernel_size // 2`` on each side) and then run "valid", as the
    reference implementations do; TF's "same" would pad only bottom/right.
    """
    if strides > 1 and kernel_size > 1:
        x = keras.layers.ZeroPadding2D(
            kernel_size // 2, data_format=_common.DATA_FORMAT, name=f"{name}_pad"
        )(x)
        padding = "valid"
    else:
        padding = "same"
    x = keras.layers.Conv2D(
        filters,
        kernel_size,
        strides=strides,
        padding=padding,
        use_bias=False,  # BN's beta replaces the bias.
        kernel_initializer="he_normal",
        data_format=_common.DATA_FORMAT,
        name=f"{name}_conv",
    )(x)
    x = keras.layers.BatchNormalization(
        axis=-1,
        momentum=bn_momentum,
        epsilon=bn_epsilon,
        gamma_initializer=gamma_initializer,
        name=f"{name}_bn",
    )(x)
    if relu:
        x = keras.layers.ReLU(name=f"{name}_relu")(x)
    return x


def _bottleneck(x, width, strides, projection, name, zero_init_gamma, bn):
    """Bottleneck block: 1x1 (width) -> 3x3/strides (width) -> 1x1 (4 * width)."""
    out_filters = width * _EXPANSION
    if projection:
        shortcut = _conv_bn(x, out_filters, 1, strides, f"{name}_0", relu=False, **bn)
    else:
        shortcut = x
    y = _conv_bn(x, width, 1, 1, f"{name}_1", **bn)
    y = _conv_bn(y, width, 3, strides, f"{name}_2", **bn)  # v1.5: stride here.
    y = _conv_bn(
        y,
        out_filters,
        1,
        1,
        f"{name}_3",
        relu=False,
        # Zero gamma makes each block start as the identity (Goyal et al. 2017).
        gamma_initializer="zeros" if zero_init_gamma else "ones",
        **bn,
    )
    y = keras.layers.Add(name=f"{name}_add")([shortcut, y])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def resnet50(
    num_classes=1000,
    input_shape=(224, 224, 3),
    zero_init_last_bn_gamma=False,
    bn_momentum=0.9,
    bn_epsilon=1e-5,
):
    """Builds ResNet-50 v1.5 returning logits.

    Architecture: 7x7/2 conv (64) + BN + ReLU, 3x3/2 max pool, four stages of
    bottleneck blocks ([3, 4, 6, 3] blocks, widths 64/128/256/512, outputs 4x the
    width) with a projection shortcut (1x1 conv + BN) in each stage's first block
    and the stride on that block's 3x3 conv, global average pooling and a Dense
    layer. Convolutions have no bias; a BN follows every convolution.

    At 1000 classes and 224x224x3 input: 25,557,032 trainable parameters and
    53,120 non-trainable (BN moving mean and variance).

    There is no weight decay in the model: the optimizer applies it (and skips
    BN parameters, whose paths contain "bn", and biases, whose paths end in
    "bias"). Under a mixed-precision global policy the layers compute in half
    precision, variables stay float32 and the logits are float32.

    Args:
        num_classes: Number of output logits.
        input_shape: ``(height, width, channels)``; height and width may be None
            (the network is fully convolutional up to global pooling). Any
            channel count works, e.g. 1 for grayscale.
        zero_init_last_bn_gamma: If True, initialise the gamma of the last BN in
            every residual block to zeros (Goyal et al. 2017), so that each block
            starts as the identity.
        bn_momentum: BatchNormalization moving-average momentum (Keras
            convention: ``moving = momentum * moving + (1 - momentum) * batch``).
        bn_epsilon: BatchNormalization epsilon.

    Returns:
        An uncompiled ``keras.Model`` named "resnet50" mapping images to
        float32 logits of shape (batch, num_classes); no softmax.

    Raises:
        ValueError: If ``num_classes`` or ``input_shape`` is invalid.

    References:
        - He et al. 2016, arXiv:1512.03385.
        - Goyal et al. 2017, arXiv:1706.02677.
        - Jia et al. 2018, arXiv:1807.11205.
    """
    _common.check_positive_int("num_classes", num_classes)
    input_shape = _common.check_input_shape(input_shape, allow_none_spatial=True)
    bn = {"bn_momentum": bn_momentum, "bn_epsilon": bn_epsilon}

    inputs = keras.Input(shape=input_shape, name="images")
    x = _conv_bn(inputs, 64, 7, 2, "conv1", **bn)
    # Zero padding is equivalent to -inf padding here: the inputs are post-ReLU.
    x = keras.layers.ZeroPadding2D(
        1, data_format=_common.DATA_FORMAT, name="pool1_pad"
    )(x)
    x = keras.layers.MaxPooling2D(
        3, strides=2, data_format=_common.DATA_FORMAT, name="pool1_pool"
    )(x)
    for stage, blocks, width, stride in _STAGES:
        for i in range(blocks):
            x = _bottleneck(
                x,
                width,
                strides=stride if i == 0 else 1,
                projection=i == 0,
                name=f"{stage}_block{i + 1}",
                zero_init_gamma=zero_init_last_bn_gamma,
                bn=bn,
            )
    x = keras.layers.GlobalAveragePooling2D(
        data_format=_common.DATA_FORMAT, name="avg_pool"
    )(x)
    outputs = _common.logits_head(x, num_classes, name="fc")
    return keras.Model(inputs, outputs, name="resnet50")
