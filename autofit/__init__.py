"""autofit: find the fastest training configuration that fits the GPU, and train with it."""

__version__ = "0.1.0"

from autofit.errors import AutofitError, DeviceError, NothingFitsError, ProfileError, SpecError, TrialError
from autofit.knobs import TrainConfig
from autofit.plan import TrainingPlan
from autofit.profile import Profile
from autofit.spec import ModelSpec, load_spec
from autofit.store import ProfileStore, load_profile
from autofit.workload.chunked import chunked_lm_loss

__all__ = [
    "AutofitError", "DeviceError", "ModelSpec", "NothingFitsError", "Profile", "ProfileError", "ProfileStore",
    "SpecError", "TrainConfig", "TrainingPlan", "TrialError", "__version__", "chunked_lm_loss", "load_profile",
    "load_spec",
]
