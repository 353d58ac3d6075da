"""Waiting in a test for something a broker (or Spark) does in its own time: polled, with a deadline that fails
the test and says what it waited for."""

import time


def wait_for(check, timeout: float = 5.0, what: str = "condition", step: float = 0.01):
    """Poll ``check`` every ``step`` seconds until it returns something true -> that value; AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(step)
