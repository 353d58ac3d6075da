"""The compiled hot path (workers/_speedups.c) is optional: without a C compiler and Python's headers the package
installs and runs on the pure-Python path (workers/purepath.py), and says so when a worker starts.  Everything
else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("workers._speedups", ["workers/_speedups.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
