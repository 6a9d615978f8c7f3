"""One exception hierarchy. The CLI turns any `AutofitError` into one line and its exit code."""


class AutofitError(Exception):
    """Something the user can fix: bad input, a missing file, an impossible request."""

    exit_code = 2


class SpecError(AutofitError):
    """A model.yaml that cannot be used; the message names the key path."""


class ProfileError(AutofitError):
    """A profile that cannot be read, found or applied."""


class DeviceError(AutofitError):
    """A device or precision that is not available here."""


class InputError(AutofitError):
    """Input found bad where it runs (in a trial child, or in the user's own code), not
    where it was read. `traceback_text` is what `--debug` prints."""

    def __init__(self, message: str, *, traceback_text: str | None = None):
        super().__init__(message)
        self.traceback_text = traceback_text


class UserCodeError(InputError):
    """The user's own `python:` code (model builder, forward, data factory) raised, or
    called sys.exit(). The message names the spec key, the `module:function`, and the
    exception's type and message."""


class NonFiniteLossError(InputError):
    """The user's model gave a NaN or infinite loss before any training (the batch-dimension
    probe): exit 3, as `autofit train` on a diverged loss."""

    exit_code = 3


class WriteError(AutofitError):
    """A file autofit could not write: a read-only or full disk, a file-size limit, a folder
    it may not write. The message names the file and says that the previous one is kept."""


class TrialError(AutofitError):
    """A trial that could not be started or whose result cannot be read."""

    exit_code = 1


class TrialTimeoutError(TrialError):
    """Trials or validation runs ran out of time: the machine was too slow or too busy, which
    says nothing about what fits. A rerun resumes the study."""


class OutOfTimeError(TrialTimeoutError):
    """The time budget ran out before any config was measured: no usable result, exit 3 as
    README's table gives it (a timeout still, so the service retries it with more time)."""

    exit_code = 3


class NothingFitsError(AutofitError):
    """No configuration fits the memory budget, or none gave a usable result."""

    exit_code = 3


# `autofit tune`'s exit code when the profile is written from the best config measured so
# far, but the time budget ran out or a stop came before its validation (or its speed-up
# over the one-liner) was done: the profile says so (search.validated, search.note).
EXIT_INCOMPLETE = 5
