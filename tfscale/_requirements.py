"""What tfscale needs installed beyond its core, and the one line that says
how to install it where it is missing (setup.py's extras).

Imports neither TensorFlow nor Keras: tfscale-train and `import tfscale`
call it before they load either.
"""

import importlib
import importlib.util

# The modules each extra of setup.py installs.
EXTRAS = {
    "plots": ("matplotlib",),
    "imagenet": ("tensorflow_datasets", "importlib_resources"),
}


def needs_tensorflow(what):
    """The one line saying that `what` (`"tfscale"`,
    `"tfscale.optimizers.HALP"`) needs TensorFlow, and how to install it."""
    return (f'{what} needs TensorFlow: pip install "tfscale[cpu]" (or [gpu], '
            "[tensorflow]: the build you want)")


TENSORFLOW_MISSING = needs_tensorflow("tfscale")


def tensorflow_missing():
    """`TENSORFLOW_MISSING` when no TensorFlow is installed (tensorflow,
    tensorflow-cpu and tensorflow[and-cuda] all install `tensorflow`), else
    None."""
    return TENSORFLOW_MISSING if importlib.util.find_spec("tensorflow") is None else None


def import_extra(module, extra, purpose):
    """Imports `module`, part of `extra` (see `EXTRAS`).

    Args:
        module: the module to import (`"matplotlib.pyplot"`).
        extra: the extra of setup.py that installs it (`"plots"`).
        purpose: what needs it, for the message (`"tfscale-bench --plot"`).

    Raises:
        ModuleNotFoundError: in one line, naming the extra to install, when
            `module` or a module of the same extra it imports is missing.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in EXTRAS[extra]:
            raise
        raise ModuleNotFoundError(
            f"{purpose} needs {error.name}, which tfscale's [{extra}] extra "
            f'installs: pip install "tfscale[{extra}]"', name=error.name) from None
