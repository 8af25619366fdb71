"""Argument checks and layer conventions shared by the model builders.

Conventions every builder follows, so that an optimizer can pick parameters out by
variable path (``variable.path``, e.g. ``"conv1_bn/gamma"``):

* every BatchNormalization layer is named ``"..._bn"``, so its gamma, beta and
  moving statistics have paths containing ``"bn"``;
* biases (only in Dense layers; convolutions followed by BN have none) have paths
  ending in ``"bias"``;
* no other layer name contains ``"bn"``.

Layout is channels_last: ``input_shape`` is ``(height, width, channels)``.
"""

import keras

# Passed to every spatial layer explicitly: the builders' input_shape convention
# is (H, W, C) whatever keras.config.image_data_format() says.
DATA_FORMAT = "channels_last"


def check_positive_int(name, value):
    """Raises ValueError unless ``value`` is an int >= 1 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}"
        )


def check_input_shape(input_shape, allow_none_spatial=False):
    """Validates and normalises an ``(height, width, channels)`` input shape.

    Args:
        input_shape: Sequence of three dimensions.
        allow_none_spatial: Whether height and width may be None (variable size).

    Returns:
        The shape as a tuple.

    Raises:
        ValueError: If the shape does not have three positive dimensions.
    """
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    ok = shape is not None and len(shape) == 3
    if ok:
        for i, dim in enumerate(shape):
            if dim is None and allow_none_spatial and i < 2:
                continue
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                ok = False
    if not ok:
        rule = "positive integers" + (
            " (height and width may be None)" if allow_none_spatial else ""
        )
        raise ValueError(
            "`input_shape` must be (height, width, channels) with "
            f"{rule}. Received: input_shape={input_shape!r}"
        )
    return shape


def logits_head(x, num_classes, name="fc"):
    """Final Dense layer, then a float32 cast so logits are float32 under any policy.

    The Dense computes in the global policy's dtype (half precision under mixed
    precision, as the paper does); the cast keeps the softmax in the loss in
    float32, as the Keras mixed-precision guide recommends.

    Args:
        x: Input tensor of shape (batch, features).
        num_classes: Number of output units.
        name: Name of the Dense layer.

    Returns:
        Logits of shape (batch, num_classes), dtype float32.
    """
    x = keras.layers.Dense(
        num_classes,
        # Small final-layer init as in Goyal et al. 2017, section 5.1.
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        bias_initializer="zeros",
        name=name,
    )(x)
    return keras.layers.Activation("linear", dtype="float32", name="logits")(x)
