"""Training: a `TrainConfig` applied to a model (`knobs`), the optimizer (`optim`), the one
training step (`runner`), the loop of `autofit train` (`loop`), a profile in the user's own
loop (`plan`), out-of-memory recovery (`recover`), data parallelism (`distributed`) and the
update-stagnation probe (`stagnation`)."""
