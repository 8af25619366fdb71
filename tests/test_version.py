"""tfscale._version: the version and the tested TensorFlow and Keras ranges,
in one place, as setup.py and tfscale.Strategy() read them."""

import os

import tfscale
from tfscale import _version

from multiworker import REPO_ROOT


def test_the_tested_ranges_in_pips_words_and_in_words():
    assert _version.requirement(_version.TENSORFLOW_MINORS) == ">=2.20,<2.22"
    assert _version.requirement(_version.KERAS_MINORS) == ">=3.13,<3.16"
    assert _version.tested() == "TensorFlow 2.20 to 2.21 and Keras 3.13 to 3.15"
    assert _version.describe(((3, 15), (3, 15))) == "3.15"


def test_is_tested_reads_the_minor_of_releases_and_pre_releases():
    assert _version.is_tested("2.20.0", "3.13.0")
    assert not _version.is_tested("2.20.0", "3.12.0")
    assert _version.is_tested("2.21.3", "3.15.1")
    assert not _version.is_tested("2.22.0rc0", "3.15.1")
    assert not _version.is_tested("2.19.0", "3.15.1")
    assert not _version.is_tested("2.21.0", "3.16.0")
    assert not _version.is_tested("2.21.0", "nightly")


def test_the_version_lives_in_one_place():
    assert tfscale.__version__ == _version.__version__
    with open(os.path.join(REPO_ROOT, "setup.py")) as f:
        setup = f.read()
    assert 'version=_VERSION["__version__"]' in setup
    assert "0.1.0" not in setup
