"""The user's own optimizer: `optimizer: {python: "module:function", args: {...}}` in a spec,
or `autofit.tune(..., optimizer=Lion)` from Python. A function or an optimizer class,
called as `fn(params, **args)` with the trainable parameters (what `model.parameters()`
would give it), used unchanged: autofit never rewrites its update or its state.
"""

import torch

from autofit.base.errors import SpecError
from autofit.workload.data import check_kwargs, load_callable, user_code

KEY_PATH = "optimizer.python"


class UserOptimizer:
    """`fn(params, **args) -> torch.optim.Optimizer`, checked once it is built. Plain data,
    so a Workload holding it pickles (an object of `autofit.tune()` pickles by value)."""

    def __init__(self, fn, args: dict, target: str):
        self.fn, self.args, self.target = fn, dict(args), target

    def __call__(self, params) -> torch.optim.Optimizer:
        with user_code(KEY_PATH, self.target, "building the optimizer"):
            optimizer = self.fn(list(params), **self.args)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SpecError(f"{KEY_PATH}: {self.target} must return a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        return optimizer


def load_user_optimizer(target: str, args: dict, source_dir) -> UserOptimizer:
    """The spec's `optimizer.python`, imported (the spec's folder first on sys.path) and its
    args checked against its signature before anything is built."""
    fn = load_callable(target, KEY_PATH, source_dir)
    check_kwargs(fn, args, "optimizer.args", target, positional=1)  # fn(params, **args)
    return UserOptimizer(fn, args, target)


def from_object(optimizer, args: dict | None = None) -> tuple[UserOptimizer, str, dict]:
    """`autofit.tune(optimizer=...)`'s callable or class (a `functools.partial` of one too):
    the factory, the name a profile records ("module:qualname") and its args."""
    args = dict(args or {})
    fn = optimizer
    while hasattr(fn, "func") and hasattr(fn, "keywords") and not fn.args:  # functools.partial
        args = {**fn.keywords, **args}
        fn = fn.func
    if not callable(fn):
        raise SpecError(f"autofit.tune: optimizer must be a torch.optim.Optimizer class or a function "
                        f"fn(params, **args), or the spec's optimizer section as a dict; got {type(fn).__name__}")
    args = {k: _plain(v, f"optimizer_args.{k}") for k, v in args.items()}
    check_kwargs(fn, args, "optimizer_args", getattr(fn, "__qualname__", "optimizer"), positional=1)
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in getattr(fn, "__name__", type(fn).__name__))
    module = getattr(fn, "__module__", None) or "__main__"
    target = f"{module}:{name or 'optimizer'}"
    return UserOptimizer(fn, args, target), target, args


def _plain(value, key_path: str):
    """A value a profile can write and read back (YAML): tuples become lists, as YAML has them."""
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{key_path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{key_path}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise SpecError(f"autofit.tune: {key_path}: the profile records your optimizer's arguments, so they are plain "
                    f"values (numbers, strings, lists, dicts); got {type(value).__name__}")
