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
    packages=setuptools.find_packages(include=["tfscale*", "models*", "launch*"]),
    # Pinned to what the tests run against: tfscale relies on private
    # TensorFlow/Keras hooks (tfscale/_private/) that move between releases.
    # GPU users: install the `tensorflow` build of the same version instead of
    # `tensorflow-cpu` (see README).
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
        "matplotlib",  # launch/studies/large_batch.py's plot
    ],
    extras_require={"test": ["pytest", "pyyaml"]},  # pyyaml: tests/test_deploy.py
    entry_points={
        "console_scripts": [
            "tfscale-train=launch.train:run",
            "tfscale-launch=launch.local:run",
            "tfscale-bench=launch.bench:run",
        ]
    },
)
