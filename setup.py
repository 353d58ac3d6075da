"""The compiled hot paths (workers/_speedups.c, workers/workqueues/_qcore.c) are optional: without a C compiler and
Python's headers the package installs and runs on the pure-Python ones (workers/purepath.py,
workers/workqueues/purecore.py), and says so when a worker starts.  Everything
else is in pyproject.toml."""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
setup(ext_modules=[Extension("workers._speedups", ["workers/_speedups.c"], optional=True, extra_compile_args=_FLAGS),
                   Extension("workers.workqueues._qcore", ["workers/workqueues/_qcore.c"], optional=True,
                             extra_compile_args=_FLAGS)])
