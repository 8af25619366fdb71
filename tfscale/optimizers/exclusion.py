"""Which variables an optimizer's weight decay (or layer adaptation) skips,
and the argument checks LARS and RMSpropWarmup share."""

import re

from tfscale._validation import is_number

# Default exclusions (used when `exclude_from_weight_decay=None`): biases and
# normalization parameters. Keras names BatchNormalization's trainable
# variables `gamma` / `beta` (path e.g. "conv1_bn/gamma"); the last pattern
# also catches other layers named with a whole "bn" token ("bn/...",
# "conv1_bn/...", "bn_conv1/...", "bn2a_branch2a/...") but not words that
# merely contain "bn" ("bneck", "bnorm").
DEFAULT_EXCLUDE = (
    r"bias",
    r"gamma",
    r"beta",
    r"batch_norm",
    r"(?:^|[/_])bn(?:[/_\d]|$)",
)


def variable_path(variable):
    """`variable.path` for Keras variables, the op name for raw tf variables."""
    path = getattr(variable, "path", None)
    if isinstance(path, str):
        return path
    name = getattr(variable, "name", "") or ""
    return name[:-2] if name.endswith(":0") else name


def excluded(variable, patterns):
    """Whether `variable`'s path matches `patterns`; None: the built-in rule
    (biases and normalization parameters: `DEFAULT_EXCLUDE` or rank <= 1)."""
    path = variable_path(variable)
    if patterns is None:
        if len(variable.shape) <= 1:
            return True
        patterns = DEFAULT_EXCLUDE
    return any(re.search(p, path) is not None for p in patterns)


def check_number(name, value, low, high=None):
    """Raises ValueError unless `low <= value (<= high)`; returns a float."""
    ok = (
        is_number(value)
        and value >= low
        and (high is None or value <= high)
    )
    if not ok:
        rule = (
            f"a number >= {low:g}"
            if high is None
            else f"a number in the range [{low:g}, {high:g}]"
        )
        raise ValueError(f"`{name}` must be {rule}. Received: {name}={value!r}")
    return float(value)


def check_patterns(name, value):
    """Validates an exclusion argument: None, or a list of regex strings."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(
            f"`{name}` must be None or a list of regular expressions "
            f"(strings). Received: {name}={value!r}"
        )
    for pattern in value:
        if not isinstance(pattern, str):
            raise ValueError(
                f"`{name}` must be None or a list of regular expressions "
                f"(strings). Received: {name}={value!r}"
            )
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"`{name}` must contain valid regular expressions; "
                f"{pattern!r} does not compile ({e}). Received: "
                f"{name}={value!r}"
            ) from None
    return tuple(value)
