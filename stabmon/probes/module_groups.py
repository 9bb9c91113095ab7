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

A model without a block container keeps depth 1 (its top-level children). Names only: the
grouping is decided once per probe layout, on the host, from parameter names and sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["MIN_BLOCKS", "ROOT_GROUP", "automatic_groups"]

#: Numbered children with parameters that make a module a block container: fewer is a small
#: ``nn.Sequential`` (a head of two layers), not a stack of blocks.
MIN_BLOCKS = 4
#: The group of parameters that sit directly on the root module (``bias`` rather than ``fc.bias``).
ROOT_GROUP = "root"


def automatic_groups(
    names: Sequence[str], max_modules: int, shapes: Sequence[tuple[int, ...]] | None = None
) -> list[str] | None:
    """The group of each parameter of ``names`` (in order), or None when the model has no
    block container (the caller then groups by top-level module). ``shapes`` (each
    parameter's) lets two or three identical blocks count as a stack too."""
    paths = [name.split(".")[:-1] for name in names]
    containers = _block_containers(names, shapes)
    if not containers:
        return None
    groups = [_group(path, containers) for path in paths]
    return _within_budget(groups, paths, containers, max_modules)


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
