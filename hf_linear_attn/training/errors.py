"""The error types of the scripts around the models."""


class UsageError(ValueError):
    """Bad input to a script (a flag, a file, a preset): the message names what is wrong and how to fix it."""


class DiskFullError(UsageError):
    """A write failed for lack of space: the message names the folder. A UsageError, so the scripts print it as
    `error: ...` instead of a traceback from deep inside torch.save."""
