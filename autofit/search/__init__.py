"""The search: an Optuna study over the space of training configs, under a memory budget.

- `search_space`: the knobs and their allowed values (`SearchSpace`);
- `memory_model`: predicted peak, calibration from measured trials, the pruning decision;
- `seeding`: the memory frontier (seeds) and refinements around a new best;
- `trial_health`: whether a low-precision trial's losses can be trusted;
- `choice`: ranking by central value, the contenders within noise and their interleaved race;
- `study`: what a study stores (`TrialRecord`), `SearchResult`, `make_study`;
- `tuner`: the ask/tell loop (`Tuner`).
"""

from autofit.search._timing import FULL_PRECISION_SLOWDOWN, slow_16_bit
from autofit.search.memory_model import MemoryModel
from autofit.search.search_space import Knob, SearchSpace
from autofit.search.study import make_study, read_records, SearchResult, TrialRecord
from autofit.search.trial_health import FIRST_LOSS_RTOL, health_problem, MEAN_LOSS_RTOL, reference_for, REFERENCE_PRECISIONS
from autofit.search.tuner import Tuner

__all__ = ["FIRST_LOSS_RTOL", "FULL_PRECISION_SLOWDOWN", "MEAN_LOSS_RTOL", "REFERENCE_PRECISIONS", "Knob", "MemoryModel", "SearchResult",
           "SearchSpace", "TrialRecord", "Tuner", "health_problem", "make_study", "read_records",
           "reference_for", "slow_16_bit"]
