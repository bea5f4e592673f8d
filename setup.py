"""Packaging for tf_memsafe: memory-safe computations for TensorFlow.

Two top-level packages are installed: ``tf_memsafe`` (the user API, the tf.function hook, the
XLA-flags companion, measurement, reports, CLI) and ``grappler_ext`` (the graph passes and their
pipeline).  The ranges below are the ones CI tests; TensorFlow's plain wheel runs on the CPU
without pulling CUDA runtimes (those only come with the ``and-cuda`` extra, which we never ask for).
"""

from setuptools import find_packages, setup

TENSORFLOW = "tensorflow>=2.21,<2.22"

EXTRAS = {
    # GPflow 2.11.2 needs tf-keras and tensorflow-probability matching TensorFlow 2.21.
    "gpflow": ["gpflow==2.11.2", "tf-keras>=2.21,<2.22", "tensorflow-probability==0.25.0"],
    "datasets": ["tensorflow-datasets==4.9.10"],
    "experiments": ["matplotlib>=3.8", "tqdm>=4.66"],
    "keops": ["pykeops==2.3"],
    "lint": ["ruff>=0.6"],
}
EXTRAS["test"] = sorted(
    {"pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6.100"}
    | set(EXTRAS["gpflow"])
    | set(EXTRAS["datasets"])
    | set(EXTRAS["experiments"])
    | set(EXTRAS["lint"])
)

setup(
    name="tf_memsafe",
    version="0.1.0",
    description="Memory-safe computations for TensorFlow: rewrite tf.function graphs before XLA "
    "compiles them so they fit a memory limit.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tf_memsafe", "tf_memsafe.*", "grappler_ext", "grappler_ext.*"]),
    install_requires=[TENSORFLOW, "numpy>=1.26,<2.5"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["tf-memsafe = tf_memsafe.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
