"""The repository's root is the ``shardbroker`` package: its folders (cluster/, workers/, router/, cli/) are where the
design put them, and installed they sit under that one name, so nothing of ours lands at the top of site-packages
beside a user's own ``cli`` or ``workers`` (docs/architecture.md#layout).

The compiled hot paths (workers/_speedups.c, workers/workqueues/_qcore.c) are optional: without a C compiler and
Python's headers the package installs and runs on the pure-Python ones (workers/purepath.py,
workers/workqueues/purecore.py), and says so when a worker starts.  Everything else is in pyproject.toml."""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py


class _BuildPy(build_py):
    """The root is the package's folder, and this script sits in it: it is not a module of the package."""

    def find_package_modules(self, package, package_dir):
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if (m[0], m[1]) != ("shardbroker", "setup")]


_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
_DISCOVERY = ["cli.spark.discovery", "cli.spark.discovery.*"]   # installed as pyspark_shardbroker, at the top
_FOLDERS = ["cluster", "cluster.*", "workers", "workers.*", "router", "router.*", "cli", "cli.*"]
setup(cmdclass={"build_py": _BuildPy},
      include_package_data=False,   # no data files; and the root's own files (this script) are not the package's
      # pyspark_shardbroker: a top-level module PySpark finds by its name and registers (cli/spark/__init__.py)
      package_dir={"shardbroker": ".", "pyspark_shardbroker": "cli/spark/discovery/pyspark_shardbroker"},
      packages=["shardbroker", "pyspark_shardbroker"]
      + ["shardbroker." + p for p in find_packages(include=_FOLDERS, exclude=_DISCOVERY)],
      ext_modules=[Extension("shardbroker.workers._speedups", ["workers/_speedups.c"], optional=True,
                             extra_compile_args=_FLAGS),
                   Extension("shardbroker.workers.workqueues._qcore", ["workers/workqueues/_qcore.c"],
                             optional=True, extra_compile_args=_FLAGS)])
