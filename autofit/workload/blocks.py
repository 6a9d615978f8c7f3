"""The block stack of a model: its repeated blocks, in forward order, which activation
checkpointing, freezing, compiling and FSDP2's units work on.

    name, blocks = find_block_stack(model)      # e.g. "transformer.h", 12 GPT-2 blocks
    blocks[3] = checkpoint_wrapper(blocks[3])   # replaced in its container

Found, not declared: the largest run of same-type children of an `nn.ModuleList` or
`nn.Sequential`, with runs of one block type in several containers joined in forward order
(torchvision's ResNet keeps its BasicBlocks in `layer1` … `layer4`; T5 in `encoder.block`
and `decoder.block`). A spec may name the stack instead (`model.blocks: layers.encoder`):
the workload declares it on every model it builds (`declare_blocks`).
"""

import weakref
from collections.abc import Iterator, Sequence

from torch import nn

from autofit.base.errors import SpecError

CONTAINERS = (nn.ModuleList, nn.Sequential)

# model -> the dotted paths of its stack's containers, as the spec names them. Weak: a
# model's entry goes with it.
_DECLARED: "weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()


class Blocks(Sequence):
    """The blocks of a stack as slots in their containers: reading gives the module,
    assigning puts another in its place (a checkpoint wrapper)."""

    def __init__(self, slots: list[tuple[nn.Module, int, str]]):
        self._slots = slots  # (container, position, the block's dotted name)

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [container[pos] for container, pos, _ in self._slots[index]]
        container, pos, _ = self._slots[index]
        return container[pos]

    def __setitem__(self, index: int, module: nn.Module) -> None:
        container, pos, _ = self._slots[index]
        container[pos] = module

    def __iter__(self) -> Iterator[nn.Module]:
        return (container[pos] for container, pos, _ in self._slots)

    @property
    def names(self) -> list[str]:
        """Each block's dotted name in the model, e.g. `layer2.0`."""
        return [name for _, _, name in self._slots]


def declare_blocks(model: nn.Module, paths: Sequence[str] | None) -> nn.Module:
    """Make `find_block_stack(model)` use these containers (the spec's `model.blocks`)."""
    if paths is not None:
        _DECLARED[model] = tuple(paths)
    return model


def find_block_stack(model: nn.Module) -> tuple[str, Blocks] | None:
    """(the stack's name, its blocks), or None when the model has no repeated blocks."""
    declared = _DECLARED.get(model)
    if declared is not None:
        return _named(model, declared)
    runs = _outermost([run for name, module in model.named_modules() if isinstance(module, CONTAINERS)
                       for run in _runs(name, module)])
    by_type: dict[type, list] = {}
    for run in runs:
        by_type.setdefault(run[0], []).append(run)
    best = None
    for block_type, group in by_type.items():
        slots = [slot for _, _, run_slots in group for slot in run_slots]
        size = sum(p.numel() for container, pos, _ in slots for p in container[pos].parameters())
        if best is None or (len(slots), size) > (len(best[1]), best[2]):
            best = (", ".join(dict.fromkeys(name or "(the model)" for _, name, _ in group)), slots, size)
    return None if best is None else (best[0], Blocks(best[1]))


def unwrap(module: nn.Module) -> nn.Module:
    """The block inside a checkpoint wrapper (torch's `CheckpointWrapper` keeps it there)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _runs(name: str, container: nn.Module) -> list[tuple[type, str, list]]:
    """Maximal runs of consecutive children of one type: (type, container name, slots).
    A block is called whole, so a ModuleList or ModuleDict is none (an nn.Sequential is);
    nor is a module without parameters (activations, dropout). A ModuleList of one type is
    a stack at any length (a one-layer GPT); elsewhere a run needs two blocks."""
    children = list(container._modules.items())
    types = [type(unwrap(child)) for _, child in children]
    whole_list = isinstance(container, nn.ModuleList) and len(set(types)) == 1
    out, start = [], 0
    for end in range(1, len(children) + 1):
        if end < len(children) and types[end] == types[start]:
            continue
        block_type, length = types[start], end - start
        first = unwrap(children[start][1])
        if ((length >= 2 or whole_list) and not issubclass(block_type, (nn.ModuleList, nn.ModuleDict))
                and next(first.parameters(), None) is not None):
            slots = [(container, pos, f"{name}.{key}" if name else key)
                     for pos, (key, _) in enumerate(children[start:end], start)]
            out.append((block_type, name, slots))
        start = end
    return out


def _outermost(runs: list) -> list:
    """Runs that lie inside no block of another run: a block's own repeated parts (an MoE
    block's experts) are not the stack. But a run of nn.Sequential stages that hold runs
    themselves (`nn.Sequential(stem, nn.Sequential(*blocks), nn.Sequential(*blocks))`) gives
    way to the blocks inside its stages."""
    def inside(container_name: str, names: set[str]) -> bool:
        parts = container_name.split(".") if container_name else []
        return any(".".join(parts[:i]) in names for i in range(1, len(parts) + 1))

    stage_names = {slot_name for block_type, _, slots in runs if issubclass(block_type, nn.Sequential)
                   for _, _, slot_name in slots}
    holding = {name for name in stage_names if any(inside(run[1], {name}) for run in runs)}
    runs = [run for run in runs if not any(slot_name in holding for _, _, slot_name in run[2])]
    block_names = {slot_name for _, _, slots in runs for _, _, slot_name in slots}
    return [run for run in runs if not inside(run[1], block_names)]


def _named(model: nn.Module, paths: tuple[str, ...]) -> tuple[str, Blocks]:
    slots = []
    for path in paths:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            found = [n for n, m in model.named_modules() if isinstance(m, CONTAINERS) and n]
            hint = f"; its nn.ModuleList/nn.Sequential modules: {', '.join(found[:8])}" if found else ""
            raise SpecError(f"model.blocks: {type(model).__name__} has no module {path!r}{hint}") from None
        if not isinstance(container, CONTAINERS):
            raise SpecError(f"model.blocks: {path} is a {type(container).__name__}, not an nn.ModuleList "
                            f"or nn.Sequential of blocks")
        slots += [(container, pos, f"{path}.{key}") for pos, key in enumerate(container._modules)]
    if not slots:
        raise SpecError(f"model.blocks: {', '.join(paths)} holds no blocks")
    return ", ".join(paths), Blocks(slots)
