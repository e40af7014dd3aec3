"""Domain errors of quantcore. Messages are written for a person: what is wrong, how to fix it."""


class QuantcoreError(Exception):
    """Base of every error quantcore raises on purpose."""


class CheckpointError(QuantcoreError, ValueError):
    """A checkpoint upload or path that quantplan refuses (pickle, unsafe archive, bad config...)."""


class PlanError(QuantcoreError, ValueError):
    """A plan (file or mapping) that names unknown schemes or layers, or breaks a fusion group."""


class Cancelled(QuantcoreError):
    """Raised by a long computation when its should_cancel() callback returns True."""


class UnsupportedOnDevice(QuantcoreError):
    """A kernel or format that the chosen device cannot run natively."""
