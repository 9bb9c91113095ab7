"""The gradient probe against torch.nn.utils.get_total_norm and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.utils import get_total_norm

from stabmon.pipeline.readback import Readback
from stabmon.probes.grads import GradProbe, build_grad_probe, group_name
from stabmon.shared.log import LogLimiter


def _named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def _measure(probe: GradProbe):  # type: ignore[no-untyped-def]
    sample = probe.measure()
    assert sample is not None
    readback: Readback[int] = Readback()
    readback.submit(0, sample.packed)
    ((_, values),) = readback.poll()
    return probe.layout.summarize(values)


def _host(packed: torch.Tensor | list[float]) -> list[float]:
    return packed if isinstance(packed, list) else packed.tolist()


def _backward(model: torch.nn.Module, inputs: torch.Tensor) -> None:
    model(inputs).pow(2).sum().backward()


def test_grad_probe_total_matches_get_total_norm() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    _backward(model, torch.randn(16, 32))
    summary = _measure(GradProbe(_named(model)))
    expected = get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert summary.total_norm == pytest.approx(float(expected), rel=1e-5)
    assert not summary.nonfinite


def test_grad_probe_module_norms_combine_to_the_global_norm() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    _backward(model, torch.randn(4, 8))
    summary = _measure(GradProbe(_named(model)))
    assert set(summary.group_norms) == {"0", "2"}
    combined = math.sqrt(sum(norm**2 for norm in summary.group_norms.values()))
    assert combined == pytest.approx(summary.total_norm, rel=1e-9)
    first_layer = get_total_norm([model[0].weight.grad, model[0].bias.grad])
    assert summary.group_norms["0"] == pytest.approx(float(first_layer), rel=1e-5)


def test_grad_probe_hand_computed_norms() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    bias = torch.nn.Parameter(torch.zeros(1))
    weight.grad = torch.tensor([3.0, 4.0])
    bias.grad = torch.tensor([12.0])
    summary = _measure(GradProbe([("layer.weight", weight), ("layer.bias", bias)]))
    assert summary.total_norm == pytest.approx(13.0)
    assert summary.group_norms == {"layer": pytest.approx(13.0)}
    assert summary.tensor_norms == pytest.approx([5.0, 12.0])


def test_grad_probe_counts_none_and_all_zero_gradients() -> None:
    present = torch.nn.Parameter(torch.zeros(3))
    zero = torch.nn.Parameter(torch.zeros(3))
    missing = torch.nn.Parameter(torch.zeros(3))
    present.grad = torch.tensor([1.0, 2.0, 2.0])
    zero.grad = torch.zeros(3)
    probe = GradProbe([("a.w", present), ("b.w", zero), ("c.w", missing)])
    summary = _measure(probe)
    assert summary.zero_grad_params == 2
    assert summary.total_norm == pytest.approx(3.0)
    assert summary.group_norms == {"a": pytest.approx(3.0), "b": 0.0, "c": 0.0}


def test_grad_probe_returns_nothing_when_no_gradient_exists() -> None:
    model = torch.nn.Linear(2, 2)
    assert GradProbe(_named(model)).measure() is None


def test_grad_probe_ignores_frozen_parameters_given_only_trainable_ones() -> None:
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)
    _backward(model, torch.randn(3, 4))
    summary = _measure(GradProbe(_named(model)))
    assert set(summary.group_norms) == {"1"}
    assert summary.total_norm == pytest.approx(
        float(get_total_norm([model[1].weight.grad, model[1].bias.grad])), rel=1e-5
    )


def test_grad_probe_measures_sparse_gradients_as_their_dense_equivalent() -> None:
    torch.manual_seed(3)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    linear = torch.nn.Linear(4, 1)
    # Index 1 twice: an uncoalesced sparse gradient with a repeated row.
    linear(embedding(torch.tensor([1, 1, 2]))).sum().backward()
    assert embedding.weight.grad is not None and embedding.weight.grad.is_sparse
    probe = GradProbe(
        [("emb.weight", embedding.weight), ("out.weight", linear.weight), ("out.bias", linear.bias)]
    )
    for _ in range(2):  # the second pass takes the remembered per-tensor path
        summary = _measure(probe)
        dense = [embedding.weight.grad.to_dense(), linear.weight.grad, linear.bias.grad]
        assert summary.total_norm == pytest.approx(float(get_total_norm(dense)), rel=1e-5)


def test_grad_probe_norms_half_precision_gradients_in_fp32_without_overflow() -> None:
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    param.grad = torch.full(
        (4,), 60000.0, dtype=torch.float16
    )  # finite; its fp16 norm would overflow
    summary = _measure(GradProbe([("w", param)]))
    assert not summary.nonfinite
    assert summary.total_norm == pytest.approx(120000.0, rel=1e-3)


def test_grad_probe_handles_mixed_dtypes_in_separate_buckets() -> None:
    a = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    a.grad = torch.tensor([3.0, 0.0], dtype=torch.float64)
    b.grad = torch.tensor([4.0, 0.0], dtype=torch.bfloat16)
    summary = _measure(GradProbe([("x.a", a), ("y.b", b)]))
    assert summary.total_norm == pytest.approx(5.0)
    assert summary.group_norms == {"x": pytest.approx(3.0), "y": pytest.approx(4.0)}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_grad_probe_flags_non_finite_and_names_the_offender(bad: float) -> None:
    good = torch.nn.Parameter(torch.zeros(2))
    broken = torch.nn.Parameter(torch.zeros(2))
    good.grad = torch.ones(2)
    broken.grad = torch.tensor([1.0, bad])
    probe = GradProbe([("encoder.w", good), ("decoder.w", broken)])
    summary = _measure(probe)
    assert summary.nonfinite
    assert probe.layout.nonfinite_offenders(summary) == ["decoder.w"]


def test_grad_probe_does_not_call_a_large_finite_total_non_finite() -> None:
    # Each tensor's norm (1e19) fits fp32, but the sum of their squares (4e38) does not.
    params = [(f"l{i}.w", torch.nn.Parameter(torch.zeros(1))) for i in range(4)]
    for _, param in params:
        param.grad = torch.tensor([1e19])
    summary = _measure(GradProbe(params))
    assert not summary.nonfinite
    assert summary.total_norm == pytest.approx(2e19, rel=1e-6)


def test_grad_probe_bounds_module_groups_by_max_modules() -> None:
    params = [(f"block{i}.w", torch.nn.Parameter(torch.zeros(i + 1))) for i in range(6)]
    for _, param in params:
        param.grad = torch.ones_like(param)
    probe = GradProbe(params, max_modules=3)
    summary = _measure(probe)
    # The two largest keep their names; the rest share "other".
    assert probe.groups == ("other", "block4", "block5")
    expected_other = math.sqrt(sum(i + 1 for i in range(4)))
    assert summary.group_norms["other"] == pytest.approx(expected_other)


@pytest.mark.parametrize(
    ("name", "depth", "group"),
    [("encoder.layers.0.weight", 1, "encoder"), ("encoder.layers.0.weight", 2, "encoder.layers"),
     ("bias", 1, "root"), ("fc.weight", 3, "fc")],
)  # fmt: skip
def test_group_name_cuts_the_module_path_at_depth(name: str, depth: int, group: str) -> None:
    assert group_name(name, depth) == group


def test_grad_probe_keeps_one_fixed_layout_as_missing_gradients_vary() -> None:
    params = [(f"expert{i}.w", torch.nn.Parameter(torch.zeros(2))) for i in range(4)]
    probe = GradProbe(params)
    sizes = set()
    for missing in range(4):  # a different expert gets no tokens each step (MoE)
        for i, (_, param) in enumerate(params):
            param.grad = None if i == missing else torch.full((2,), float(i + 1))
        sample = probe.measure()
        assert sample is not None and sample.none_count == 1
        sizes.add(len(_host(sample.packed)))
        summary = _measure(probe)
        assert summary.zero_grad_params == 1
        assert summary.group_norms[f"expert{missing}"] == 0.0
    assert len(sizes) == 1


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_grad_probe_measures_a_gradient_that_turns_none_after_steps_with_all_present(
    sparse: bool,
) -> None:
    embedding = torch.nn.Embedding(4, 2, sparse=sparse)
    head = torch.nn.Linear(2, 1)
    probe = GradProbe([("embedding.weight", embedding.weight), *_named_with(head, "head")])
    for _ in range(3):  # every gradient present: the fused path without counting
        head(embedding(torch.tensor([1, 2]))).sum().backward()
        summary = _measure(probe)
        assert summary.zero_grad_params == 0
        embedding.zero_grad(), head.zero_grad()
    head(torch.ones(1, 2)).sum().backward()  # the embedding is unused this step: its grad is None
    summary = _measure(probe)
    assert summary.zero_grad_params == 1
    assert summary.group_norms["embedding"] == 0.0
    expected = get_total_norm([head.weight.grad, head.bias.grad])
    assert summary.total_norm == pytest.approx(float(expected), rel=1e-6)


def _named_with(module: torch.nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}.{name}", param) for name, param in module.named_parameters()]


def test_grad_probe_follows_parameters_moved_after_it_was_built() -> None:
    model = torch.nn.Linear(3, 1)
    probe = GradProbe(_named(model))
    model.to(torch.float64)  # moves (re-types) the same Parameter objects in place
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    summary = _measure(probe)
    expected = get_total_norm([model.weight.grad, model.bias.grad])
    assert summary.total_norm == pytest.approx(float(expected), rel=1e-9)


def test_grad_probe_keeps_clean_module_norms_finite_when_one_module_is_nan() -> None:
    clean = torch.nn.Parameter(torch.zeros(2))
    broken = torch.nn.Parameter(torch.zeros(2))
    clean.grad = torch.tensor([3.0, 4.0])
    broken.grad = torch.tensor([float("nan"), 1.0])
    summary = _measure(GradProbe([("encoder.w", clean), ("decoder.w", broken)]))
    assert summary.group_norms["encoder"] == pytest.approx(5.0)  # where the NaN is not
    assert math.isnan(summary.group_norms["decoder"])


@pytest.mark.parametrize("layers", [3, 40])  # 6 norms read one by one; 80 stacked, numpy sums
def test_host_sums_match_torch_and_keep_a_nan_in_its_own_group(layers: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(layers)))
    model(torch.randn(2, 4)).sum().backward()
    probe = GradProbe(list(model.named_parameters()), max_modules=1024)
    sample = probe.measure()
    assert sample is not None
    summary = probe.layout.summarize(_host(sample.packed))
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert summary.total_norm == pytest.approx(float(expected), rel=1e-6)
    for index, layer in enumerate(model):
        layer_norm = torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()])
        assert summary.group_norms[str(index)] == pytest.approx(float(layer_norm), rel=1e-6)

    model[1].weight.grad[0, 0] = float("nan")
    sample = probe.measure()
    assert sample is not None
    poisoned = probe.layout.summarize(_host(sample.packed))
    assert poisoned.nonfinite and math.isnan(poisoned.total_norm)
    assert math.isnan(poisoned.group_norms["1"])
    assert all(math.isfinite(norm) for group, norm in poisoned.group_norms.items() if group != "1")


def test_groups_and_named_parameters_follow_the_model_not_the_optimizers_groups() -> None:
    # Hugging Face's Trainer gives the optimizer every decayed weight first, then every bias
    # and norm: a NaN in two blocks must still be named block by block as the model runs.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": weights[::-1]}, {"params": biases}], lr=0.1)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    model[2].bias.grad = torch.full((4,), float("nan"))
    model[1].weight.grad = torch.full((4, 4), float("nan"))
    probe = build_grad_probe(model.named_parameters(), optimizer, module_depth=1,
                             max_modules=32, limiter=LogLimiter())  # fmt: skip

    assert probe.groups == ("0", "1", "2", "3")
    sample = probe.measure()
    assert sample is not None
    summary = probe.layout.summarize(torch.as_tensor(sample.packed).tolist())
    assert probe.layout.nonfinite_offenders(summary) == ["1.weight", "2.bias"]
    bad = [group for group, norm in summary.group_norms.items() if norm != norm]
    assert bad == ["1", "2"]
