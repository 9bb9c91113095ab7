"""Compare the data-parallel replicas' parameters on the device: the measuring half of the
replica check (stabmon.detectors.replica judges and words the verdict).

Every ``replica_check_steps`` optimizer steps, after the step, each rank fingerprints its
parameters per module group (:mod:`stabmon.probes.fingerprint`: two int64 per group), the
fingerprints are gathered across the replica group with an asynchronous ``all_gather``
whose result the device waits for (NCCL: a stream wait, never the host), the vote runs on
the device and its few floats come back with the Monitor's batched readback a step or more
later: no host-device synchronisation on the step. The check is keyed to the optimizer
steps this probe has seen since attach, the same count on every rank, so every rank issues
the same collectives in the same order; not to the step's number, which a resumed run may
number differently on some ranks (one that restored a Monitor state the others did not):
ranks that gathered at different iterations would pair the gather with another collective
and hang. It never runs inside an evaluation or any phase some ranks skip.

The replica group is found, not configured: a model wrapped in DistributedDataParallel
compares across its process group; parameters that are DTensors on a 2-D mesh (HSDP,
``fully_shard`` with a replicate dimension) compare their local shards across the mesh
dimension that replicates them; parameters sharded on every dimension (FSDP, ZeRO-3) have
no replicas: that is said once, and nothing is issued. A model without either compares
nothing (tensor- or pipeline-parallel ranks hold different parameters by design).
"""

from __future__ import annotations

import itertools
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stabmon.extension import Context
from stabmon.probes.fingerprint import abstention, fingerprint, vote
from stabmon.probes.grads import assign_groups
from stabmon.probes.identity import torch_device_uuids
from stabmon.probes.local_norms import LocalGradNorms
from stabmon.probes.local_norms import install as install_local_norms

__all__ = [
    "ReplicaGroup", "ReplicaProbe", "find_replica_group", "home_device", "parameter_buckets",
]  # fmt: skip


@dataclass(frozen=True)
class ReplicaGroup:
    """The process group whose members must hold identical parameters, and what to compare."""

    group: Any  # a torch.distributed ProcessGroup
    ranks: tuple[int, ...]  # global ranks, in group order
    named_tensors: tuple[tuple[str, torch.Tensor], ...]  # this rank's (local) parameters
    how: str  # "DDP" or "HSDP mesh dimension <name>"


def _unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def find_replica_group(model: torch.nn.Module, how: str = "auto") -> ReplicaGroup | str:
    """The replica group of ``model``, or why there is none (a sentence for the log).

    ``how`` is the ``replica_group`` setting: ``"world"`` takes every rank of the default
    process group as a replica of the others (a DDP model seen without its wrapper).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialised: one process, no replicas"
    model = _unwrap_compiled(model)
    ddp = torch.nn.parallel.DistributedDataParallel
    if how == "world" and not isinstance(model, ddp):
        world = dist.group.WORLD
        everything: tuple[tuple[str, torch.Tensor], ...] = tuple(model.named_parameters())
        if any(hasattr(param, "device_mesh") for _, param in everything):
            return "replica_group: world, but the parameters are DTensors (sharded): use auto"
        return ReplicaGroup(
            world, tuple(range(dist.get_world_size())), everything,
            "every rank (replica_group: world)",
        )  # fmt: skip
    if isinstance(model, ddp):
        group = model.process_group
        named = tuple(_ddp_synchronised(model))
        return ReplicaGroup(group, tuple(dist.get_process_group_ranks(group)), named, "DDP")
    # Frozen parameters too: a corrupted frozen weight (a fine-tuned base model) skews that
    # replica's gradients from then on while the trained ones stay identical (all-reduced).
    # Plain tensors beside DTensors (a module fully_shard left out) are not known to be
    # replicated the mesh's way: left out.
    named_params = [(n, p) for n, p in model.named_parameters() if hasattr(p, "device_mesh")]
    meshes = {id(p.device_mesh): p for _, p in named_params}
    if not meshes:
        return (
            "the model is not wrapped in DistributedDataParallel and its parameters are not "
            "DTensors: which ranks hold the same parameters is unknown (attached to the "
            "module inside DDP, as the Lightning and Hugging Face adapters do? set "
            "replica_group: world)"
        )
    if len(meshes) > 1:
        return "the parameters live on more than one device mesh"
    sample: Any = next(iter(meshes.values()))  # a DTensor parameter
    mesh = sample.device_mesh
    replicate = [dim for dim, placement in enumerate(sample.placements) if placement.is_replicate()]
    if not replicate:
        return (
            "every parameter is sharded on every mesh dimension (FSDP/ZeRO-3): no rank holds "
            "a replica of another's parameters"
        )
    dim = replicate[0]
    group = mesh.get_group(dim)
    named = tuple((n, p.to_local()) for n, p in named_params)  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names
    label = names[dim] if names else str(dim)
    return ReplicaGroup(
        group, tuple(dist.get_process_group_ranks(group)), named, f"HSDP mesh dimension {label}"
    )


def _ddp_synchronised(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The parameters DDP keeps identical: every one, frozen ones too, but those it was told
    to ignore (``_set_params_and_buffers_to_ignore_for_model``: they may differ by design);
    the ones whose all-reduce it delays are in that set too, yet all-reduced, so kept."""
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    delayed = {id(p) for p in getattr(model, "_delay_all_reduce_params", ())}
    return [
        (name, param)
        for name, param in model.module.named_parameters()
        if name not in ignored or id(param) in delayed
    ]


def home_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """Where the check's results and collectives live: the first accelerator holding a
    parameter (a model partly offloaded to the CPU gathers on its GPU, as NCCL needs), else
    the CPU."""
    devices = [tensor.device for _, tensor in named]
    return next((device for device in devices if device.type != "cpu"), devices[0])


#: Bytes of a member's "host GPU-uuid" in the first check's gather (longer is cut).
_WHERE_BYTES = 256
#: Attaches in this process so far: every rank that attaches alike counts in the same key.
_attaches = itertools.count()


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _answer_roll_call(ranks: Sequence[int]) -> str | None:
    """Count this rank in the store key of the group's replica check (at attach); the key,
    or None where there is no store to count in."""
    key = f"stabmon/replica_check/{next(_attaches)}/{','.join(map(str, ranks))}"
    try:
        _store().add(key, 1)
    except Exception:
        return None
    return key


def parameter_buckets(
    named: Sequence[tuple[str, torch.Tensor]], depth: int, max_modules: int
) -> tuple[list[str], list[list[torch.Tensor]]]:
    """Parameters by module group, exactly as the gradient norms name them (same grouping,
    same ``max_modules`` cap with ``other``)."""
    groups, group_of = assign_groups(
        (name for name, _ in named), [tensor for _, tensor in named], depth, max_modules
    )
    buckets: list[list[torch.Tensor]] = [[] for _ in groups]
    for index, (_, tensor) in zip(group_of, named, strict=True):
        buckets[index].append(tensor)
    return list(groups), buckets


class ReplicaProbe:
    """Fingerprints, gathers and votes after the due optimizer steps (the training thread)."""

    def __init__(
        self,
        replicas: ReplicaGroup,
        every: int,
        depth: int,
        max_modules: int,
        *,
        roll_call: str | None = None,
        off: Callable[[str], None] | None = None,
        local_norms: LocalGradNorms | None = None,
    ) -> None:
        self.replicas = replicas
        #: Each rank's gradient norm before the all-reduce (replica_local_norms), or None.
        self.local_norms = local_norms
        #: The store key each member's attach counted itself in (None: no store, no count).
        self._roll_call = roll_call
        #: Says, once, why the check turned itself off (an event and a log line).
        self._off = off
        self.ranks: tuple[int, ...] = replicas.ranks
        self.how = replicas.how
        self._every = every
        #: Optimizer steps between checks (the verdict's "agreed at the check before").
        self.every = every
        self.group_names, self._buckets = parameter_buckets(
            replicas.named_tensors, depth, max_modules
        )
        #: "host GPU-uuid" of each member, learnt at the first check.
        self.where: list[str] = []
        #: Optimizer steps seen since attach: what the checks are keyed to (every rank alike).
        self._seen = 0
        self._device = home_device(replicas.named_tensors)

    @classmethod
    def create(cls, context: Context) -> ReplicaProbe | None:
        """The probe of ``context``'s model, or None (off, or no replicas: said once)."""
        config = context.config
        if config.replica_check_steps <= 0:
            return None
        found = find_replica_group(context.model, config.replica_group)
        if isinstance(found, str):
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                context.event("replica_check", state="off", reason=found)
                context.log(
                    "replica_check", logging.INFO,
                    "stabmon: replica check off on rank %d: %s", context.rank, found,
                )  # fmt: skip
            return None
        if len(found.ranks) < 2 or not found.named_tensors:
            return None

        def off(reason: str) -> None:
            context.event("replica_check", state="off", reason=reason)
            context.log(
                "replica_check", logging.WARNING,
                "stabmon: replica check off on rank %d: %s", context.rank, reason,
            )  # fmt: skip

        local_norms = None
        if config.replica_local_norms:
            device = home_device(found.named_tensors)
            installed = install_local_norms(_unwrap_compiled(context.model), device)
            if isinstance(installed, str):
                context.log(
                    "replica_local_norms", logging.WARNING,
                    "stabmon: local gradient norms off on rank %d: %s", context.rank, installed,
                )  # fmt: skip
            else:
                local_norms = installed
        return cls(
            found, config.replica_check_steps, config.module_depth, config.max_modules,
            roll_call=_answer_roll_call(found.ranks), off=off, local_norms=local_norms,
        )  # fmt: skip

    def measure(self, step: int) -> torch.Tensor | None:
        """After optimizer step ``step``, when due: fingerprint, gather and vote, all on the
        device; the vote (:func:`stabmon.probes.fingerprint.vote`) is read back later."""
        self._seen += 1
        if self.local_norms is not None:
            self.local_norms.fold()
        if self._seen % self._every:
            return None
        replicas = self.replicas
        if not self.where:
            if not self._all_attached():
                return None
            self.where = self._gather_where()
        device = self._device
        failed: Exception | None = None
        try:
            local = fingerprint(self._buckets, device)
        except Exception as error:  # this rank alone (out of memory...): the others gather
            failed, local = error, abstention(len(self._buckets), device)
        if self.local_norms is not None:  # one more row: [the interval's local norm, 0]
            norm = self.local_norms.take().to(device).view(torch.int64)
            local = torch.cat([local, torch.stack([norm, torch.zeros_like(norm)]).unsqueeze(0)])
        gathered = [torch.empty_like(local) for _ in replicas.ranks]
        work = dist.all_gather(gathered, local, group=replicas.group, async_op=True)
        if work is not None:
            work.wait()  # NCCL: the current stream waits for the collective; the host does not
        if failed is not None:
            raise failed  # contained and counted; the others judged without this rank
        stacked = torch.stack(gathered)
        if self.local_norms is None:
            return vote(stacked)
        norms = stacked[:, -1, 0].view(torch.float64).float()  # per member, in group order
        return torch.cat([vote(stacked[:, :-1]), norms])

    def _all_attached(self) -> bool:
        """At the first check: whether every member of the group attached stabmon (a loop may
        monitor rank 0 alone; its gathers would wait for ranks that never join, or pair
        with DDP's all-reduce). Read from the process group's store, not a collective; by
        the first check every member that attaches at the start has (the ranks' steps are
        in lockstep), so every member reads the same count and decides alike."""
        if self._roll_call is None:
            return True
        try:
            attached = _store().add(self._roll_call, 0)
        except Exception:  # no store to read: as before, every rank is taken to be there
            return True
        if attached >= len(self.ranks):
            return True
        self._every = sys.maxsize  # never due again
        if self._off is not None:
            self._off(
                f"stabmon is attached on {attached} of the {len(self.ranks)} ranks of the "
                f"replica group ({self.how}): a check would wait for ranks that never take "
                "part; attach stabmon on every rank to compare the replicas"
            )
        return False

    def _gather_where(self) -> list[str]:
        """Each member's host and GPU, once, at the first check: UTF-8 bytes in a tensor on
        the parameters' device, gathered like the fingerprints (not all_gather_object,
        whose tensors go to torch.cuda.current_device(): the same GPU on every rank of a
        node whose loop never called set_device, an NCCL error). Read on the host once."""
        device = self._device
        try:  # a failure here must not leave the others waiting in the gather
            uuids = torch_device_uuids([device])
            mine = f"{socket.gethostname()} {uuids[0] if uuids else device}"
        except Exception:
            mine = "host unknown"
        encoded = mine.encode("utf-8", "replace")[:_WHERE_BYTES]
        local = torch.zeros(_WHERE_BYTES, dtype=torch.uint8)
        if encoded:
            local[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        local = local.to(device)
        where = [torch.empty_like(local) for _ in self.ranks]
        dist.all_gather(where, local, group=self.replicas.group)
        # A slow path, once per run (the first check): the gathered names are read back here,
        # a host-device sync that the steps after it never make.
        return [
            bytes(item.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace") for item in where
        ]
