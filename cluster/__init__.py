"""Supervisor, acceptor, configuration and the other cluster-wide pieces."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("shardbroker")  # pyproject.toml is the one place the version is written
except PackageNotFoundError:  # running from a checkout that was never installed
    VERSION = "0.0.0+unknown"
