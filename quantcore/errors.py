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


MAX_PROBLEM_CHARS = 2000  # one problem of a message, at most
MAX_NAMES_IN_MESSAGE = 12  # long lists of layer names are cut in error messages


def name_list(names, limit: int = MAX_NAMES_IN_MESSAGE) -> str:
    """'a', 'b', 'c' and 5 more: a readable, bounded list of names for a message."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    rest = len(names) - limit
    return shown + (f" and {rest} more" if rest > 0 else "")


def format_problems(title: str, problems) -> str:
    """One message for every problem found at once: 'title: p' or 'title (n problems):' and a list."""
    # a problem quoting a value of the input (a rule, a layer entry) is cut: a message never prints a whole document
    problems = [p if len(str(p)) <= MAX_PROBLEM_CHARS else str(p)[: MAX_PROBLEM_CHARS - 1] + "…" for p in problems]
    if len(problems) == 1:
        return f"{title}: {problems[0]}"
    return f"{title} ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems)
