"""Durations read from environment variables, one parse and one error message for all of them."""
import os


def seconds_from_env(name, default, minimum, meaning):
    """The number of seconds the environment variable `name` sets, else `default` (unset or
    empty); a value that is not a number >= `minimum` is refused naming the variable and
    `meaning` (what the value does)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= minimum:
        raise ValueError("%s must be a number of seconds >= %g (%s), got %r"
                         % (name, minimum, meaning, raw))
    return value
