"""tfscale: large-batch multi-worker training for TensorFlow/Keras (Jia et al. 2018)."""

import setuptools

setuptools.setup(
    name="tfscale",
    version="0.1.0",
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
    # Pinned to what the tests run against: tfscale relies on private
    # TensorFlow/Keras hooks (tfscale/_private/) that move between releases.
    # GPU users: install the `tensorflow` build of the same version instead of
    # `tensorflow-cpu` (see docs/gpus.md).
    install_requires=[
        "tensorflow-cpu==2.21.*",
        "keras==3.15.*",
        "tensorflow-datasets==4.9.*",
        "importlib_resources",  # needed by tensorflow-datasets, not pulled in by it
        "absl-py",
        "tensorboard",  # tf.summary's writer; tensorflow-cpu does not bring it
        "scikit-learn",
        "scipy",  # cost_model.fit's least squares (imported directly)
        "numpy",
        "matplotlib",  # launch/studies/large_batch/plot.py
    ],
    extras_require={"test": ["pytest", "pyyaml"]},  # pyyaml: tests/test_deploy.py
    entry_points={
        "console_scripts": [
            "tfscale-train=tfscale.launch.train:run",
            "tfscale-launch=tfscale.launch.local:run",
            "tfscale-bench=tfscale.launch.bench:run",
        ]
    },
)
