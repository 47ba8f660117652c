class DSparkError(Exception):
    """A user-facing error: the message is one actionable line, printed without a traceback."""
