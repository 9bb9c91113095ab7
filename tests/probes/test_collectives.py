"""The collective counters' process-wide wrappers: installed once, restored by the last user."""

from __future__ import annotations

import types

from stabmon.probes.collectives import CollectiveCounter


def _fake_distributed() -> tuple[types.ModuleType, types.FunctionType]:
    module = types.ModuleType("fake_distributed")

    def barrier() -> None:
        pass

    module.barrier = barrier  # type: ignore[attr-defined]
    return module, barrier  # type: ignore[return-value]


def test_collective_counter_detached_first_leaves_the_chain_and_the_last_restores_torch() -> None:
    module, original = _fake_distributed()
    first, second = CollectiveCounter(modules=(module,)), CollectiveCounter(modules=(module,))
    first.install()
    second.install()
    module.barrier()
    first.uninstall()  # the first Monitor detaches while the second still trains
    module.barrier()
    assert (first.issued, second.issued) == (1, 2)
    second.uninstall()
    assert module.barrier is original


def test_collective_counter_restores_torch_whichever_detaches_first() -> None:
    module, original = _fake_distributed()
    first, second = CollectiveCounter(modules=(module,)), CollectiveCounter(modules=(module,))
    first.install()
    second.install()
    second.uninstall()
    module.barrier()
    assert (first.issued, second.issued) == (1, 0)
    first.uninstall()
    assert module.barrier is original


def test_collective_counter_uninstall_is_idempotent() -> None:
    module, original = _fake_distributed()
    first, second = CollectiveCounter(modules=(module,)), CollectiveCounter(modules=(module,))
    first.install()
    second.install()
    first.uninstall()
    first.uninstall()  # a second detach must not release the other Monitor's hold
    assert module.barrier is not original
    module.barrier()
    assert second.issued == 1
    second.uninstall()
    assert module.barrier is original


def test_a_collective_counts_once_after_a_reattach_under_somebody_elses_wrapper() -> None:
    module, _ = _fake_distributed()
    first = CollectiveCounter(modules=(module,))
    first.install()
    ours = module.barrier

    def theirs() -> None:  # a profiler or another library wraps barrier after stabmon
        ours()

    module.barrier = theirs  # type: ignore[attr-defined]
    first.uninstall()  # ours stays inside their chain: it cannot be unwrapped under theirs
    second = CollectiveCounter(modules=(module,))
    second.install()  # a new wrapper over theirs, which still calls the old one
    module.barrier()
    assert (second.issued, second.current) == (1, None)
    second.uninstall()
