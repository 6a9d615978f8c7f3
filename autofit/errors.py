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


class TrialError(AutofitError):
    """A trial that could not be started or whose result cannot be read."""

    exit_code = 1


class NothingFitsError(AutofitError):
    """No configuration fits the memory budget, or none gave a usable result."""

    exit_code = 3
