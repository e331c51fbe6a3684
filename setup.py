"""Package discovery for setuptools (everything else is in pyproject.toml): every package
under localrun/, and kernels/ (with any subpackage) shipped as localrun.kernels."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["localrun", "localrun.*"])
      + ["localrun.kernels"] + [f"localrun.kernels.{p}" for p in find_packages("kernels")])
