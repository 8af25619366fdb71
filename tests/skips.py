"""Skips shared by several test modules, each printing its reason (-rs)."""

import pytest

from tfscale import fashion_mnist_source


def _fashion_mnist_missing():
    """The line saying how to get Fashion-MNIST, or None where it is found."""
    try:
        fashion_mnist_source.find()
    except FileNotFoundError as error:
        return str(error)
    return None


FASHION_MNIST_MISSING = _fashion_mnist_missing()
needs_fashion_mnist = pytest.mark.skipif(
    FASHION_MNIST_MISSING is not None, reason=FASHION_MNIST_MISSING or "")
