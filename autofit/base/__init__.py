"""The floor every other layer stands on: errors, sizes, atomic files, redaction, logging,
stop signals and paths. Nothing here imports torch, optuna or another autofit layer."""
