"""tfscale._requirements: without TensorFlow, or without an extra's module,
one line says what to install."""

import importlib.util
import re

import pytest

import tfscale
from tfscale import _requirements


def test_without_tensorflow_strategy_names_what_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "tensorflow"
                        else find_spec(name, *rest))
    message = ('tfscale needs TensorFlow: pip install "tfscale[cpu]" (or [gpu], '
               "[tensorflow]: the build you want)")
    assert _requirements.tensorflow_missing() == message
    with pytest.raises(ModuleNotFoundError, match=f"^{re.escape(message)}$"):
        tfscale.__getattr__("Strategy")


def test_with_tensorflow_nothing_is_missing():
    assert _requirements.tensorflow_missing() is None


def test_a_module_of_an_extra_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=re.escape(
            "tfscale-bench --plot needs matplotlib, which tfscale's [plots] extra "
            'installs: pip install "tfscale[plots]"')):
        _requirements.import_extra("matplotlib", "plots", "tfscale-bench --plot")


def test_another_module_missing_is_not_blamed_on_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tensorflow_datasets", None)
    with pytest.raises(ModuleNotFoundError, match="tensorflow_datasets") as raised:
        _requirements.import_extra("tensorflow_datasets", "plots", "a plot")
    assert "pip install" not in str(raised.value)
