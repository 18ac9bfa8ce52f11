"""One error type for bad input. The CLI turns it into a one-line message and exit code 2."""


class SpecterError(Exception):
    """A user-facing problem: missing or corrupt file, a budget that can't fit, a model without experts."""
