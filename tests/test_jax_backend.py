"""tfscale's toolbox on Keras's JAX backend with no TensorFlow installed
(DESIGN.md: the toolbox and models import without TensorFlow).

Runs in the JAX tier (.ci/jax: a virtual environment with `.[test-jax]`
and no TensorFlow, KERAS_BACKEND=jax), beside the toolbox's own test modules
(test_lars, test_rmsprop_warmup, test_loss_scale, test_schedules,
test_recipes, test_models), which run there unchanged. Here: what only that
environment can show. The toolbox imports without TensorFlow, every
TensorFlow-only name says so in one line, and
docs/examples/jax_data_parallel.py trains in this process (one device, no
jax.distributed).
"""

import importlib.util
import os
import re

import keras
import pytest

if keras.backend.backend() != "jax" or importlib.util.find_spec("tensorflow"):
    pytest.skip("needs KERAS_BACKEND=jax and no TensorFlow installed (.ci/jax makes "
                f"that environment); here: Keras's backend {keras.backend.backend()}, "
                f"TensorFlow {'installed' if importlib.util.find_spec('tensorflow') else 'absent'}",
                allow_module_level=True)

from tfscale import _requirements  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "docs", "examples", "jax_data_parallel.py")


def test_the_toolbox_imports_without_tensorflow():
    from tfscale import batch_growth, models, optimizers, recipes, schedules

    assert optimizers.__all__ == ["LARS", "LossScaleOptimizer", "RMSpropWarmup"]
    assert models.names() == ["alexnet_bn", "alexnet_bn_small", "resnet50"]
    assert "alexnet_bn_lars_8k" in recipes.RECIPES
    assert issubclass(schedules.WarmupPolynomialDecay,
                      keras.optimizers.schedules.LearningRateSchedule)
    assert batch_growth.parse("30:5") == ((30, 5),)


@pytest.mark.parametrize("module, name", [
    ("tfscale", "Strategy"),
    ("tfscale", "CommunicationOptions"),
    ("tfscale", "data"),
    ("tfscale.optimizers", "HALP"),
    ("tfscale.optimizers", "SVRG"),
    ("tfscale.optimizers", "LowPrecisionSGD"),
    ("tfscale.optimizers", "quantize"),
    ("tfscale.models", "VarianceReducedModel"),
])
def test_what_needs_tensorflow_says_so_in_one_line(module, name):
    what = "tfscale" if module == "tfscale" else f"{module}.{name}"
    message = _requirements.needs_tensorflow(what)
    with pytest.raises(ModuleNotFoundError, match=f"^{re.escape(message)}$"):
        getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_an_attribute_error():
    from tfscale import models, optimizers

    for module in (optimizers, models):
        with pytest.raises(AttributeError, match="has no attribute 'LAMB'"):
            module.LAMB  # noqa: B018


@pytest.fixture
def example():
    """docs/examples/jax_data_parallel.py as a module; the distribution it
    sets is unset afterwards."""
    spec = importlib.util.spec_from_file_location("jax_data_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()


def test_the_docs_example_trains_with_the_lars_recipe_in_one_process(example):
    """The script's DataParallel fit with tfscale's LARS recipe, on this
    process's one device (2 processes: docs/jax.md)."""
    keras.utils.set_random_seed(0)
    args = example.parse_args(["--process_id=0", "--num_processes=1", "--epochs=6"])
    metrics = example.train(args)
    assert isinstance(keras.distribution.distribution(), keras.distribution.DataParallel)
    assert metrics["accuracy"] > 0.9, metrics


@pytest.mark.parametrize("argv, said", [
    (["--process_id=2", "--num_processes=2"], "--process_id must be in [0, --num_processes)"),
    (["--process_id=0", "--epochs=2"], "--epochs must be more than the warmup (2)"),
])
def test_the_docs_example_refuses_bad_arguments(example, argv, said, capsys):
    with pytest.raises(SystemExit):
        example.parse_args(argv)
    assert said in capsys.readouterr().err
