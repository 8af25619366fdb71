"""For the test modules that also run on Keras's JAX backend without
TensorFlow (the JAX tier, .ci/jax; tests/README.md): the marks of a test
that needs TensorFlow itself, or float64."""

import keras
import pytest

BACKEND = keras.backend.backend()

# tf.function, tf.data, tfscale.Strategy: a test of one imports TensorFlow
# in its body, so that its module imports without it.
tensorflow_only = pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason=f"needs TensorFlow (Keras's backend here: {BACKEND})")


def _jax_float64():
    import jax

    return jax.config.jax_enable_x64


# JAX computes in float32 unless jax_enable_x64 is set: a float64 variable is
# a float32 one there, and a float64 reference meets it at float32's rounding.
float64 = pytest.mark.skipif(
    BACKEND == "jax" and not _jax_float64(),
    reason="float64 on JAX needs jax_enable_x64 (JAX_ENABLE_X64=1)")
