"""tfscale: the large-batch training system of Jia et al. 2018 for Keras 3.

    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(...))
    with strategy.scope():
        model.compile(optimizer=tfscale.optimizers.LARS(...), ...)
    model.fit(...)

The package loads lazily (PEP 562), as TensorFlow's own does: `import
tfscale` imports neither TensorFlow nor Keras, so that tfscale-launch
(`tfscale.launch.local`), which only starts and watches worker processes,
stays a small process that starts at once. The first use of any name below
imports all of tfscale (and registers its Keras serializables: a model saved
with `tfscale.optimizers.LARS` loads once any tfscale name has been used, or
after `from tfscale import optimizers`).

Without TensorFlow, on another Keras backend (`KERAS_BACKEND=jax`), the
backend-neutral toolbox loads alone: `from tfscale import optimizers,
schedules, recipes, models` (and `batch_growth`). Every other name says in
one line that it needs TensorFlow.
"""

import importlib

from tfscale import _requirements
from tfscale._version import __version__

# Public name -> the module that defines it (a submodule: itself).
_NAMES = {
    "batch_growth": "tfscale.batch_growth",
    "callbacks": "tfscale.callbacks",
    "data": "tfscale.data",
    "evaluator": "tfscale.evaluator",
    "optimizers": "tfscale.optimizers",
    "recipes": "tfscale.recipes",
    "schedules": "tfscale.schedules",
    "slurm": "tfscale.slurm",
    "StartupError": "tfscale.startup",
    "CommunicationOptions": "tfscale.collectives.options",
    "PowerSGDOptions": "tfscale.collectives.options",
    "Strategy": "tfscale.strategy",
}

# The toolbox (DESIGN.md, Layers): keras.ops or plain Python, no TensorFlow.
# Without TensorFlow each loads by itself instead of with everything.
_BACKEND_NEUTRAL = ("batch_growth", "optimizers", "recipes", "schedules")

__all__ = sorted(_NAMES)


def _load_all():
    """Imports every public name into this module (what an eager
    `__init__` would have done). Without TensorFlow: one line naming what
    to install."""
    missing = _requirements.tensorflow_missing()
    if missing:
        raise ModuleNotFoundError(missing, name="tensorflow")
    for name, module_name in _NAMES.items():
        module = importlib.import_module(module_name)
        globals()[name] = module if module_name == f"tfscale.{name}" else getattr(
            module, name)


def __getattr__(name):
    if name in _NAMES:  # a public name loads them all (see the module)
        if name in _BACKEND_NEUTRAL and _requirements.tensorflow_missing():
            return importlib.import_module(f"tfscale.{name}")
        _load_all()
        return globals()[name]
    # A submodule used as an attribute (`tfscale.strategy.X` after `import
    # tfscale`; `from tfscale import flight_report`): that one alone.
    try:
        return importlib.import_module(f"tfscale.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"tfscale.{name}":
            raise
    raise AttributeError(f"module 'tfscale' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
