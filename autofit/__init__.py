"""autofit: find the fastest training configuration that fits the GPU, and train with it."""

__version__ = "0.1.0"

from autofit.errors import AutofitError, DeviceError, NothingFitsError, ProfileError, SpecError, TrialError
from autofit.knobs import TrainConfig
from autofit.spec import ModelSpec, load_spec

__all__ = [
    "AutofitError", "DeviceError", "ModelSpec", "NothingFitsError", "ProfileError", "SpecError",
    "TrainConfig", "TrialError", "__version__", "load_spec",
]
