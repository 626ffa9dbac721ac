"""The one exception type the jobs turn into a one-line error and a non-zero exit."""


class PipelineError(Exception):
    """Bad input or state the user can fix; the message names the field or file."""
