"""Type checks shared by tfscale's argument validation.

`bool` is a subclass of `int` in Python, so `isinstance(True, int)` holds;
arguments that take counts, sizes or rates must refuse `True`/`False`.
"""

import math
import numbers


def is_int(value):
    """Whether `value` is an integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value):
    """Whether `value` is a real number (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_number(value):
    """Whether `value` is a real number (Python or NumPy), not a bool, NaN
    or infinite."""
    return is_number(value) and math.isfinite(value)
