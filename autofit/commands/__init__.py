"""One module per CLI verb: a plain function with typed arguments (`tune_command`, ...), which
Python callers use and which raises `AutofitError`s, and `main(args)`, which the CLI calls and
which prints. Argument checks live in `args`. (`doctor` and `serve`/`status` are the
doctor's and the service's own, a layer up.)"""
