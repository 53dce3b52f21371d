"""Keeps the `*_test.py` files that live beside the code out of the wheel."""

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithoutTests(build_py):

  def find_package_modules(self, package, package_dir):
    return [m for m in super().find_package_modules(package, package_dir)
            if not m[1].endswith("_test")]


setup(cmdclass={"build_py": BuildPyWithoutTests})
