"""What runs beside the workers and what they share with it: the supervisor (``supervisor``), the configuration
and the protocol registry (``config``), security (``security``), monitoring (``monitoring``), and the control
channel, runtime directory and logging both sides use (``control``, ``runtime``, ``logs``)."""


def __getattr__(name: str) -> str:
    # VERSION is looked up on first use: importlib.metadata costs ~15 ms of imports, and workers (which import
    # this package for its config and control modules) never need it.
    if name != "VERSION":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("shardbroker")  # pyproject.toml is the one place the version is written
    except PackageNotFoundError:  # running from a checkout that was never installed
        value = "0.0.0+unknown"
    globals()["VERSION"] = value
    return value
