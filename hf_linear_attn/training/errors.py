"""The one error type of the scripts around the models."""


class UsageError(ValueError):
    """Bad input to a script (a flag, a file, a preset): the message names what is wrong and how to fix it."""
