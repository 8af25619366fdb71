"""tfscale: large-batch multi-worker training for TensorFlow/Keras (Jia et al. 2018)."""

import os

import setuptools

# The version and the tested TensorFlow and Keras releases, read without
# importing tfscale (tfscale/_version.py imports nothing).
_VERSION = {}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tfscale",
                       "_version.py"), encoding="utf-8") as f:
    exec(f.read(), _VERSION)
_TENSORFLOW = _VERSION["requirement"](_VERSION["TENSORFLOW_MINORS"])  # >=2.20,<2.22
_KERAS = _VERSION["requirement"](_VERSION["KERAS_MINORS"])  # >=3.13,<3.16
_PLOTS = ["matplotlib"]
# ImageNet (tfscale.imagenet_source); tensorflow-datasets needs
# importlib_resources and does not bring it.
_IMAGENET = ["tensorflow-datasets>=4.9,<5", "importlib_resources"]
# Keras's JAX backend on CPU, for the toolbox (optimizers, schedules,
# recipes) and the models without TensorFlow (docs/jax.md).
_JAX = ["jax[cpu]"]

setuptools.setup(
    name="tfscale",
    version=_VERSION["__version__"],
    description=(
        "Large-batch, multi-worker Keras training: a working multi-worker "
        "model.fit, fused and hierarchical all-reduce, LARS under mixed precision."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The repository keeps models/ and launch/ beside tfscale/; they install
    # inside tfscale's namespace (tfscale.models, tfscale.launch), so no
    # top-level `models` or `launch` lands in site-packages to collide with
    # another project's. The studies (launch/studies/) stay out of the wheel:
    # run them from a checkout installed with `pip install -e .`.
    packages=(setuptools.find_packages(include=["tfscale", "tfscale.*"])
              + ["tfscale.models", "tfscale.launch", "tfscale.launch.bench"]),
    package_dir={"tfscale.models": "models", "tfscale.launch": "launch"},
    # No TensorFlow here: tensorflow, tensorflow-cpu and tensorflow[and-cuda]
    # all provide `tensorflow`, and pip cannot say "one of them"
    # (tensorflow/tensorflow#7166, #48165); a second one beside the user's
    # overwrites its files. The extras name the build, as tensorflow-addons
    # and Horovod did; without any, tfscale.Strategy() and tfscale-train say
    # what to install. Ranges, not pins: tfscale relies on private
    # TensorFlow/Keras hooks (tfscale/_private/), checked at Strategy() and
    # tested on these releases (tfscale/_version.py).
    install_requires=[
        f"keras{_KERAS}",
        "absl-py",
        "numpy",
        "scikit-learn",  # the digits (tfscale.data); brings scipy (cost_model.fit)
        "tensorboard",  # tf.summary's writer; tensorflow-cpu 2.21 does not bring it
    ],
    extras_require={
        "cpu": [f"tensorflow-cpu{_TENSORFLOW}"],
        "gpu": [f"tensorflow[and-cuda]{_TENSORFLOW}"],
        "tensorflow": [f"tensorflow{_TENSORFLOW}"],
        "plots": _PLOTS,  # tfscale-bench --plot, timeline plots, studies
        "imagenet": _IMAGENET,
        # pyyaml: tests/test_deploy.py; pytest-xdist: README's test command
        # and fast tier, on two processes; the suite also tests the plots and
        # ImageNet's reader.
        "test": ["pytest", "pytest-xdist", "pyyaml", *_PLOTS, *_IMAGENET],
        "jax": _JAX,
        # The JAX tier (.ci/jax), in an environment without TensorFlow. Not
        # in [test]: jax and jaxlib (380 MB) would sit unused where Keras
        # runs on TensorFlow.
        "test-jax": ["pytest", *_JAX],
    },
    entry_points={
        "console_scripts": [
            "tfscale-train=tfscale.launch.train:run",
            "tfscale-launch=tfscale.launch.local:run",
            "tfscale-bench=tfscale.launch.bench:run",
        ]
    },
)
