"""Module groups that fit the model: one per repeated block, plus the stem and the head.

Per-module gradient norms, dead-branch reports and NaN naming are only as useful as the
groups they are summed over. A fixed depth fits nothing real: at depth 1 nanoGPT is two
groups (``transformer``, ``lm_head``), so a NaN in block 7 is reported "in transformer",
the whole body. Models repeat their blocks under a container whose children are numbered
(``transformer.h.0`` ... ``transformer.h.11``, ``model.layers.N`` in Hugging Face models,
``model.0`` ... ``model.23`` in Ultralytics YOLO, ``encoder.block.N`` and
``decoder.block.N`` in T5), so the automatic grouping (``module_depth: 0``, the default):

- finds every *block container*: a module whose numbered children hold parameters, at
  least :data:`MIN_BLOCKS` of them (or two or more identical ones: the same parameter
  names and shapes, a small model's stack), and which is not inside another block
  container (the experts of an MoE layer inside a block stay in their block);
- gives each block its own group (``transformer.h.7``);
- groups every other parameter by its path down to the first module where it leaves the
  nearest container's path: ``transformer.wte`` and ``transformer.ln_f`` (the stem and the
  final norm beside ``transformer.h``), ``lm_head`` (the head);
- within ``max_modules``: blocks are merged into runs of consecutive blocks
  (``model.layers.0-3``) when there are more than the budget left by the other groups.

A model without a block container is grouped by its top-level children, below the wrappers
every parameter shares: a LightningModule's ``self.model`` around a ``self.net`` MLP is
``model.net.0``, ``model.net.2``, ``model.net.4`` (one group per layer, as the bare
``nn.Sequential`` gets), not the single group ``model``. In either case a multi-layer
``nn.LSTM``/``GRU``/``RNN`` that is a group of its own is split by layer (``rnn.l0``,
``rnn.l1``: torch names its weights ``weight_ih_l1``, ``weight_hh_l1_reverse``), since its
layers are the blocks an LSTM language model repeats. Names only: the grouping is decided
once per probe layout, on the host, from parameter names and sizes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["MIN_BLOCKS", "ROOT_GROUP", "automatic_groups"]

#: Numbered children with parameters that make a module a block container: fewer is a small
#: ``nn.Sequential`` (a head of two layers), not a stack of blocks.
MIN_BLOCKS = 4
#: The group of parameters that sit directly on the root module (``bias`` rather than ``fc.bias``).
ROOT_GROUP = "root"
#: torch's recurrent modules' per-layer parameters: ``weight_ih_l1``, ``bias_hh_l0_reverse``.
_RNN_LAYER = re.compile(r"(?:weight|bias)_(?:ih|hh|hr)_l(\d+)(?:_reverse)?")


def automatic_groups(
    names: Sequence[str], max_modules: int, shapes: Sequence[tuple[int, ...]] | None = None
) -> list[str] | None:
    """The group of each parameter of ``names`` (in order), or None when the model has no
    block container, no shared wrapper and no multi-layer RNN of its own (the caller then
    groups by top-level module). ``shapes`` (each parameter's) lets two or three identical
    blocks count as a stack too."""
    paths = [name.split(".")[:-1] for name in names]
    containers = _block_containers(names, shapes)
    if containers:
        groups = _within_budget(
            [_group(path, containers) for path in paths], paths, containers, max_modules
        )
    else:
        groups = _below_wrappers(paths)
    groups = _rnn_layers(names, groups)
    if not containers and groups == [".".join(path[:1]) or ROOT_GROUP for path in paths]:
        return None  # the top-level children are the groups
    return groups


def _below_wrappers(paths: Sequence[list[str]]) -> list[str]:
    """Each parameter's top-level child below the module path every parameter shares (a
    framework's or the user's wrapper: ``model.net``); the top-level child without one."""
    shared = max(min((len(path) - 1 for path in paths), default=0), 0)
    for depth in range(shared):
        if len({path[depth] for path in paths}) > 1:
            shared = depth
            break
    return [".".join(path[: shared + 1]) or ROOT_GROUP for path in paths]


def _rnn_layers(names: Sequence[str], groups: list[str]) -> list[str]:
    """Split a multi-layer recurrent module that is a group of its own into its layers."""
    layers: dict[str, set[str]] = {}
    found: list[tuple[int, str]] = []
    for index, (name, group) in enumerate(zip(names, groups, strict=True)):
        module, _, leaf = name.rpartition(".")
        match = _RNN_LAYER.fullmatch(leaf)
        if match is not None and (module or ROOT_GROUP) == group:
            layers.setdefault(group, set()).add(match.group(1))
            found.append((index, match.group(1)))
    split = list(groups)
    for index, layer in found:
        if len(layers[groups[index]]) > 1:
            split[index] = f"{groups[index]}.l{layer}"
    return split


def _block_containers(
    names: Sequence[str], shapes: Sequence[tuple[int, ...]] | None
) -> list[tuple[str, ...]]:
    """Outermost modules with at least MIN_BLOCKS numbered children that hold parameters, or
    at least two whose parameters are the same names and shapes (a small model's blocks)."""
    children: dict[tuple[str, ...], dict[str, set[tuple[str, tuple[int, ...]]]]] = {}
    for index, name in enumerate(names):
        parts = name.split(".")
        shape = shapes[index] if shapes is not None else ()
        for depth, part in enumerate(parts[:-1]):
            if part.isdigit():
                block = children.setdefault(tuple(parts[:depth]), {}).setdefault(part, set())
                block.add((".".join(parts[depth + 1 :]), shape))
    found = sorted(prefix for prefix, blocks in children.items() if _is_stack(blocks, shapes))
    outermost: list[tuple[str, ...]] = []
    for prefix in found:  # sorted: a container comes before the ones nested in it
        if not any(prefix[: len(outer)] == outer for outer in outermost):
            outermost.append(prefix)
    return outermost


def _is_stack(
    blocks: dict[str, set[tuple[str, tuple[int, ...]]]], shapes: Sequence[tuple[int, ...]] | None
) -> bool:
    if len(blocks) >= MIN_BLOCKS:
        return True
    signatures = {frozenset(block) for block in blocks.values()}
    return shapes is not None and len(blocks) >= 2 and len(signatures) == 1


def _group(path: list[str], containers: Sequence[tuple[str, ...]]) -> str:
    if not path:
        return ROOT_GROUP
    best = 0
    for container in containers:
        depth = len(container)
        if tuple(path[:depth]) == container and len(path) > depth:
            return ".".join(path[: depth + 1])  # one block
        best = max(best, _common_prefix(path, container))
    return ".".join(path[: best + 1])  # where it leaves the nearest container's path


def _common_prefix(path: Sequence[str], container: Sequence[str]) -> int:
    length = 0
    for mine, theirs in zip(path, container, strict=False):
        if mine != theirs:
            break
        length += 1
    return length


def _within_budget(
    groups: list[str],
    paths: Sequence[list[str]],
    containers: Sequence[tuple[str, ...]],
    max_modules: int,
) -> list[str]:
    """Merge consecutive blocks of each container into runs when the groups exceed
    ``max_modules``; the other groups keep their names."""
    blocks: dict[tuple[str, ...], set[int]] = {}
    for path in paths:
        for container in containers:
            depth = len(container)
            if tuple(path[:depth]) == container and len(path) > depth:
                blocks.setdefault(container, set()).add(int(path[depth]))
    block_groups = sum(len(numbers) for numbers in blocks.values())
    others = len(set(groups)) - block_groups
    budget = max(len(blocks), max_modules - others)
    if block_groups <= budget:
        return groups
    per_run = math.ceil(block_groups / budget)
    renamed: dict[str, str] = {}
    for container, numbers in blocks.items():
        ordered = sorted(numbers)
        for start in range(0, len(ordered), per_run):
            run = ordered[start : start + per_run]
            label = ".".join([*container, f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0])])
            for number in run:
                renamed[".".join([*container, str(number)])] = label
    return [renamed.get(group, group) for group in groups]
