"""The directories the configuration names, checked against the file system at load: a start must be able to use
them, and the error is the key's, not a traceback.

The keys are found by their metadata (``cluster.config.sections``' ``_directory``): a new directory key is checked
without another line of code here.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Any

from shardbroker.cluster.config.schema import ConfigError
from shardbroker.cluster.config.sections import Config


def check_directories(config: Config) -> None:
    for key, kind, path in directory_keys(config, ""):
        if key == "queues.data_dir" and not config.queues.journal:
            continue  # unused: a start must not fail over it
        problem = (_usable_parent if kind == "parent" else _creatable_directory)(path)
        if problem:
            raise ConfigError(f"{key}: {path!r} {problem}")


def directory_keys(node: Any, prefix: str):
    """(key, kind, path) for every directory key that is set."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if f.metadata.get("directory") and value is not None:
            yield prefix + f.name, f.metadata["directory"], value
        elif dataclasses.is_dataclass(value):
            yield from directory_keys(value, f"{prefix}{f.name}.")


def _usable_parent(path: str) -> str | None:
    """Why the broker cannot make its private directories in ``path``, or None."""
    if not path:
        return "is not a directory (give null for the default)"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be used: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"is not writable by this user (mode {stat.S_IMODE(st.st_mode):04o})"
    if (why := _unwritable(path)) is not None:
        return f"is not writable by this user: {why}"
    # There anyone could rename the broker's directory away and put their own in its place, endpoints included;
    # the sticky bit (as on /tmp) lets only an entry's owner rename or remove it.
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (f"is writable by every user without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"another user could replace what the broker puts there")
    return None


def _creatable_directory(path: str) -> str | None:
    """Why the broker cannot use ``path`` as its own directory (made, mode 0700, if missing), or None."""
    if not path:
        return "is not a directory (give null for the default)"
    if os.path.isdir(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            return f"is not readable and writable by this user (mode {mode:04o})"
        if (why := _unwritable(path)) is not None:
            return f"is not readable and writable by this user: {why}"
        if mode & stat.S_IWOTH:  # the journal names are fixed: anyone could plant one (sticky bit or not)
            return f"is writable by every user (mode {mode:04o}): another user could plant or replace journals"
        return None
    if os.path.lexists(path):
        return "is not a directory"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK) or _unwritable(parent) is not None:
        return f"cannot be created: {parent} is not writable by this user"
    return None


def _unwritable(path: str) -> str | None:
    """Why no directory can be made in ``path`` (the error's words), or None: found by making one and removing it.
    The mode bits are not the whole answer: root passes every access check, yet a read-only or special file
    system (sysfs, a read-only bind mount) refuses it, and the start would fail there with a traceback."""
    import tempfile  # here: only a start's path check needs it

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".shardbroker-probe-", dir=path))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
