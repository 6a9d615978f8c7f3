"""autofit: find the fastest training configuration that fits the GPU, and train with it.

    import autofit
    profile = autofit.load_profile("gpt-small")      # tuned by `autofit tune model.yaml`
    with profile.apply(model) as plan:
        ...
    profile = autofit.tune(model, batch_fn, loss_fn, autofit.TuneOptions(global_batch_size=32))  # a model in a notebook

The public API is the names in `__all__`; each is imported from its module the first time
it is used (as optuna does), so `import autofit` and the `autofit` command start without
loading torch. Everything else is internal and may move.
"""

import importlib

from autofit.base.version import VERSION as __version__

# name -> the module that defines it
_PUBLIC = {
    "AutofitError": "autofit.base.errors",
    "DeviceError": "autofit.base.errors",
    "NothingFitsError": "autofit.base.errors",
    "ProfileError": "autofit.base.errors",
    "SpecError": "autofit.base.errors",
    "TrialError": "autofit.base.errors",
    "WriteError": "autofit.base.errors",
    "ModelSpec": "autofit.config.spec",
    "load_spec": "autofit.config.spec",
    "TrainConfig": "autofit.config.train_config",
    "TrainingPlan": "autofit.train.training_plan",
    "Profile": "autofit.profiles.profile",
    "ProfileStore": "autofit.profiles.store",
    "load_profile": "autofit.profiles.store",
    "chunked_lm_loss": "autofit.workload.chunked",
    "tune": "autofit.tuning.notebook",
    "TuneOptions": "autofit.tuning.notebook",  # `autofit.tune`'s settings as one value
    "train_model": "autofit.tuning.notebook",  # not `train`: the package autofit.train holds that name
}

__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'autofit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
