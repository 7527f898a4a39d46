"""The error types both sides of the product raise and the command line reports, each with its exit code.

Stdlib only: the engine, the daemon and the command line import it; it imports none of them.
"""


class ConfigError(ValueError):
    """A config that cannot run (exit 78); the message is one line naming the key and what is allowed."""


class DataError(ValueError):
    """Bad input data (exit 65); the message is one line naming the file and what is wrong."""


class CantCreateError(DataError):
    """An output cannot be created (permissions, a read-only or virtual filesystem): exit 73."""
