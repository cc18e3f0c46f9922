"""The error hierarchy. A leaf module: the solver and the DB import it without the runtime."""


class UcudnnError(Exception):
    """Base of every error ucudnn raises on purpose."""


class InvalidInput(UcudnnError, ValueError):
    """An argument broke a rule; the message names the argument, the value and the rule."""


class UnsupportedProblem(UcudnnError):
    """A backend or algorithm cannot run this problem (the message says why)."""


class BackendUnavailable(UcudnnError):
    """A backend was asked for but cannot be used on this machine (the message says what is missing)."""


class DatabaseError(UcudnnError):
    """The measurement cache could not be opened, read or written (the message says which file and why)."""
