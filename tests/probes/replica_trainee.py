"""One rank of a gloo job on CPU that trains data-parallel replicas the way real loops do.

    torchrun --standalone --nproc_per_node=N replica_trainee.py RUN_DIR MODE:STEPS[,...]

Each ``MODE:STEPS`` runs in turn in the same ranks (issue 43: five processes importing torch
and a gloo rendezvous cost more than most modes' training): each mode builds its own model,
DDP wrapper, optimizer and Monitor (``run_id`` ``replicas-MODE``), undoes its own injections
and writes its own folder ``RUN_DIR/replicas-MODE``, ending with each rank's
``rank-R.checks.json`` (the checks its ReplicaCheck judged) on the ranks that attached.
``rank0`` must come last: only rank 0 attaches there, and every rank's attaches must count
alike (the replica check's roll call keys on them).

MODE: ``flip`` (one mantissa bit of ``blocks.1.0.weight`` flipped on rank 2 after step
``FLIP_AFTER``, then training goes on; ``flip2`` the same on rank 0 of two), ``clean``
(bf16 autocast, gradient accumulation of two micro-batches with ``no_sync``, clipping, DDP's
gradient bucket views), ``straggler``
(rank 1 sleeps a little each step), ``fsdp`` (``fully_shard`` on a 1-D mesh: no replicas),
``hsdp`` (``fully_shard`` on a 2x2 mesh, replicate x shard; rank 2's shard corrupted after
``FLIP_AFTER``), ``skew`` (``flip`` in a resumed run whose step numbering differs across
ranks: rank 0 restored a Monitor state of step ``SKEW``, the others none), ``fail``
(``flip``, and rank 1's fingerprints fail from ``FLIP_AFTER`` on: an injected error, as an
out-of-memory on that rank alone would be), ``frozen`` (``flip`` of the frozen ``stem``,
beside a parameter DDP is told to ignore whose value differs on every rank by design),
``rank0`` (``clean``, with stabmon attached on rank 0 alone, as a loop that monitors one
rank does), ``local`` (rank 2's gradient is multiplied by 10^6 in the backward of
``blocks.1`` at step ``FLIP_AFTER``, before the all-reduce: a bad backward kernel; every
replica then applies the same corrupted average). ``clean`` and ``local`` also take each
rank's local gradient norm (``replica_local_norms``).
Checks run every
``CHECK_EVERY`` steps; a collective that waits more than a minute fails the job.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import stabmon
from stabmon.detectors.replica import ReplicaCheck

FLIP_AFTER = 50
CHECK_EVERY = 10
CORRUPTED_RANK = 2
SKEW = 7
FLIPPED = ("flip", "flip2", "hsdp", "skew", "fail", "frozen", "world")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.head(x)
        return out


def flip_one_bit(tensor: torch.Tensor) -> None:
    """Flip the lowest mantissa bit of one element, in place (what a bad GPU might do)."""
    with torch.no_grad():
        tensor.view(-1).view(torch.int32)[5] ^= 1


def build(mode: str) -> tuple[nn.Module, nn.Module]:
    """(what the loop calls and stabmon is attached to, the module holding the parameters)."""
    torch.manual_seed(0)
    net = Net()
    if mode in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        if mode == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, net
    if mode == "frozen":
        net.stem.requires_grad_(False)  # frozen, as a fine-tuned base model is
        net.local = nn.Module()  # a submodule: DDP's reducer names a top-level one ".name"
        net.local.scale = nn.Parameter(torch.full((3,), float(dist.get_rank())))
        ddp = nn.parallel.DistributedDataParallel
        ddp._set_params_and_buffers_to_ignore_for_model(net, ["local.scale"])
    return nn.parallel.DistributedDataParallel(net), net


def main() -> None:
    run_dir = sys.argv[1]
    runs = [(mode, int(steps)) for mode, steps in (r.split(":") for r in sys.argv[2].split(","))]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for mode, steps in runs:
        if dist.get_rank() == 0:  # a failure's traceback follows the mode it happened in
            print(f"replica_trainee: mode {mode} ({steps} steps)", file=sys.stderr, flush=True)
        train(run_dir, mode, steps)
        dist.barrier()  # no rank starts the next mode's collectives before all ended this one
    dist.destroy_process_group()


def train(run_dir: str, mode: str, steps: int) -> None:
    """One mode, start to end, leaving nothing behind for the next."""
    import stabmon.probes.replicas as replicas

    taken = replicas.fingerprint
    try:
        run_mode(run_dir, mode, steps)
    finally:
        replicas.fingerprint = taken  # type: ignore[assignment]  # fail's injection


def run_mode(run_dir: str, mode: str, steps: int) -> None:
    rank = dist.get_rank()
    model, net = build(mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # world: as the Lightning and Hugging Face adapters do, attach to the module inside DDP.
    extra: dict[str, object] = {"replica_group": "world"} if mode == "world" else {}
    if mode in ("clean", "local"):
        extra["replica_local_norms"] = True
    if mode == "local" and rank == CORRUPTED_RANK:

        def scale(grad: torch.Tensor) -> torch.Tensor:
            return grad * 1e6 if scale.now else grad  # type: ignore[attr-defined]

        scale.now = False  # type: ignore[attr-defined]
        net.blocks[1].register_forward_hook(
            lambda module, args, out: out.register_hook(scale) and None
        )
    monitor = stabmon.attach(
        net if mode == "world" else model, optimizer, port=0, run_dir=run_dir,
        run_id=f"replicas-{mode}", replica_check_steps=CHECK_EVERY, **extra,
    ) if mode != "rank0" or rank == 0 else None  # fmt: skip
    if (
        mode == "skew" and rank == 0 and monitor
    ):  # resumed from a state the other ranks did not load
        state = monitor.state_dict()
        monitor.load_state_dict({**state, "step": SKEW})
    if mode == "fail" and rank == 1:
        import stabmon.probes.replicas as replicas

        taken = replicas.fingerprint

        def failing(*args: object, **kwargs: object) -> torch.Tensor:
            if failing.now:  # type: ignore[attr-defined]
                raise MemoryError("injected: out of memory on rank 1 alone")
            return taken(*args, **kwargs)  # type: ignore[arg-type]

        failing.now = False  # type: ignore[attr-defined]
        replicas.fingerprint = failing  # type: ignore[assignment]
    generator = torch.Generator().manual_seed(1000 + rank)
    accumulate = 2 if mode == "clean" else 1
    for step in range(steps):
        for micro in range(accumulate):
            last = micro == accumulate - 1
            syncing = contextlib.nullcontext() if last or mode != "clean" else model.no_sync()
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "clean")
            with syncing, autocast:
                loss = model(torch.randn(8, 16, generator=generator)).float().pow(2).mean()
            (loss / accumulate).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if monitor:
            monitor.observe(loss=loss)
        if mode == "straggler" and rank == 1:
            time.sleep(0.002)
        corrupted = 0 if mode == "flip2" else CORRUPTED_RANK  # flip2: a job of two ranks
        if mode == "local" and rank == corrupted:
            scale.now = step + 1 == FLIP_AFTER  # type: ignore[attr-defined]
        if mode == "fail" and rank == 1 and step == FLIP_AFTER:
            replicas.fingerprint.now = True  # type: ignore[attr-defined]
        if mode in FLIPPED and rank == corrupted and step == FLIP_AFTER:
            weight = net.stem.weight if mode == "frozen" else net.blocks[1][0].weight
            flip_one_bit(weight.to_local() if hasattr(weight, "to_local") else weight)
    if monitor:
        monitor.detach()  # the last checks' votes are read back and judged here
        checks = [p.checks for p in monitor._plugged.plugins if isinstance(p, ReplicaCheck)]
        Path(run_dir, f"replicas-{mode}", f"rank-{rank}.checks.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main()
