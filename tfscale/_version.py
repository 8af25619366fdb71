"""tfscale's version and the TensorFlow and Keras releases it is tested with:
the one place for both. setup.py reads this file without importing tfscale
(it imports nothing), `tfscale.__version__` is `__version__`, and
`tfscale.Strategy()` checks its private hooks against the tested releases
(`tfscale._private.hooks`).
"""

__version__ = "0.1.0"

# Tested minor releases, first and last (both included). TensorFlow 2.20
# requires Keras >= 3.10 and 2.21 Keras >= 3.12 (their wheels' metadata);
# tfscale needs Keras >= 3.13: its build hook reads the epoch iterator's
# (first step, last step, data), from 3.11, and TerminateOnNonFiniteLoss
# passes TerminateOnNaN's raise_error, from 3.13. Keras 3.13 was current when
# TensorFlow 2.21 came out (2026-03-06), and a fresh install of either
# TensorFlow takes the newest, 3.15.
TENSORFLOW_MINORS = ((2, 20), (2, 21))
KERAS_MINORS = ((3, 13), (3, 15))


def requirement(minors):
    """The pip version range of `minors` (first, last): `">=2.20,<2.22"`."""
    (major, first), (_, last) = minors
    return f">={major}.{first},<{major}.{last + 1}"


def describe(minors):
    """`minors` in words: `"2.20 to 2.21"` (`"3.15"` when one)."""
    (major, first), (_, last) = minors
    return f"{major}.{first}" if first == last else f"{major}.{first} to {major}.{last}"


def is_within(version, minors):
    """Whether the release `version` (`"2.21.0"`, `"2.22.0rc0"`) is one of
    `minors`."""
    parts = version.split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return minors[0] <= found <= minors[1]


def is_tested(tensorflow_version, keras_version):
    """Whether tfscale is tested with this TensorFlow and this Keras."""
    return (is_within(tensorflow_version, TENSORFLOW_MINORS)
            and is_within(keras_version, KERAS_MINORS))


def tested():
    """The tested versions in words: "TensorFlow 2.20 to 2.21 and Keras 3.13
    to 3.15"."""
    return (f"TensorFlow {describe(TENSORFLOW_MINORS)} and Keras "
            f"{describe(KERAS_MINORS)}")
