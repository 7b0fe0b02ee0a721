"""Packaging shim: metadata lives in pyproject.toml.

Only the package list is here, because pyproject.toml alone cannot map a
folder outside ``src/`` into the package: the checkout's ``kernels/`` (kernel
sources and their manifest) ships inside the wheel as
``qwen_apple_backend/_kernels``.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages("src") + ["qwen_apple_backend._kernels"],
    package_dir={"": "src", "qwen_apple_backend._kernels": "kernels"},
)
