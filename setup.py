"""Packaging shim: metadata lives in pyproject.toml.

Only the package list is here, because pyproject.toml alone cannot map a
folder outside ``src/`` into the package: the checkout's ``kernels/`` (kernel
sources and their manifest) ships inside the wheel as
``qwen_apple_backend/_kernels``.
"""

from setuptools import find_packages, setup

# Folders of data files (no __init__.py) are listed as packages too: setuptools
# ships a folder's files only through a package, and warns about importable
# folders missing from this list.
DATA_PACKAGES = [
    "qwen_apple_backend._kernels",
    "qwen_apple_backend._kernels.cuda",
    "qwen_apple_backend._kernels.metal",
    "qwen_apple_backend.demo_model",
]

setup(
    packages=find_packages("src") + DATA_PACKAGES,
    package_dir={"": "src", "qwen_apple_backend._kernels": "kernels"},
)
