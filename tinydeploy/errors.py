"""The one error type users see. The CLI prints it as one line and exits with code 2."""


class TinydeployError(Exception):
    """A problem with the user's input or environment, explained in one line with what to do next."""

