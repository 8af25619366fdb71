"""Plain Keras model builders for tfscale (depend on keras only: any Keras
backend), and `VarianceReducedModel`, the `keras.Model` that trains a model
with HALP or SVRG (tfscale.optimizers; TensorFlow only).

Every builder returns an uncompiled ``keras.Model`` that maps channels_last images
to float32 logits (no softmax), computes in the global dtype policy (half
precision under "mixed_float16" / "mixed_bfloat16") and keeps float32 variables.
BatchNormalization variable paths contain "bn" and bias paths end in "bias", so
an optimizer can exclude them from weight decay by regex.

Example:

    from tfscale import models
    model = models.get("resnet50", num_classes=1000)
"""

import importlib.util

from tfscale.models.alexnet import alexnet_bn
from tfscale.models.alexnet import alexnet_bn_small
from tfscale.models.resnet import resnet50

# The builders are plain Keras (any backend); VarianceReducedModel's
# train step is TensorFlow's (tf.GradientTape, tf.data, tf.distribute).
# Without TensorFlow, naming it says so in tfscale._requirements' words
# (written out: models/ imports nothing of tfscale).
if importlib.util.find_spec("tensorflow") is not None:
    from tfscale.models.variance_reduced import VarianceReducedModel
else:
    def __getattr__(name):
        if name == "VarianceReducedModel":
            raise ModuleNotFoundError(
                "tfscale.models.VarianceReducedModel needs TensorFlow: pip install "
                '"tfscale[cpu]" (or [gpu], [tensorflow]: the build you want)',
                name="tensorflow")
        raise AttributeError(f"module 'tfscale.models' has no attribute {name!r}")

_BUILDERS = {
    "alexnet_bn": alexnet_bn,
    "alexnet_bn_small": alexnet_bn_small,
    "resnet50": resnet50,
}


def names():
    """Returns the sorted list of model names accepted by `get`."""
    return sorted(_BUILDERS)


def get(name, **kwargs):
    """Builds a model by name.

    Args:
        name: One of `names()`, e.g. "resnet50" or "alexnet_bn".
        **kwargs: Keyword arguments of the builder, e.g. ``num_classes``.

    Returns:
        The ``keras.Model`` built by the named builder.

    Raises:
        ValueError: If ``name`` is not a known model name.
    """
    try:
        builder = _BUILDERS[name]
    except (KeyError, TypeError):  # TypeError: unhashable name.
        raise ValueError(
            f"Unknown model name: {name!r}. Known: {', '.join(names())}"
        ) from None
    return builder(**kwargs)


__all__ = [
    "VarianceReducedModel",
    "alexnet_bn",
    "alexnet_bn_small",
    "get",
    "names",
    "resnet50",
]
