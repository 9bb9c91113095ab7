"""stabmon.probes.module_groups: one group per repeated block plus the stem and the head,
on the parameter names of the models people train (nanoGPT, Hugging Face Llama, Ultralytics
YOLO, T5), and on real nn.Modules whose gradient norms are then read by module group."""

from __future__ import annotations

import torch
from torch import nn

from stabmon.probes.grads import GradProbe, build_grad_probe
from stabmon.probes.module_groups import automatic_groups
from stabmon.shared.log import LogLimiter


def _nanogpt_names(layers: int) -> list[str]:
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(layers):
        names += [f"transformer.h.{i}.ln_1.weight", f"transformer.h.{i}.attn.c_attn.weight",
                  f"transformer.h.{i}.mlp.c_fc.weight"]  # fmt: skip
    return [*names, "transformer.ln_f.weight", "lm_head.weight"]


def test_automatic_groups_give_nanogpt_one_group_per_block_plus_stem_and_head() -> None:
    names = _nanogpt_names(12)
    groups = automatic_groups(names, max_modules=32)
    assert groups is not None
    by_name = dict(zip(names, groups, strict=True))
    assert by_name["transformer.h.1.mlp.c_fc.weight"] == "transformer.h.1"
    assert by_name["transformer.wte.weight"] == "transformer.wte"
    assert by_name["transformer.ln_f.weight"] == "transformer.ln_f"
    assert by_name["lm_head.weight"] == "lm_head"
    assert len(set(groups)) == 12 + 4


def test_automatic_groups_fit_llama_yolo_and_an_encoder_decoder() -> None:
    llama = ["model.embed_tokens.weight"]
    llama += [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(32)]
    llama += ["model.norm.weight", "lm_head.weight"]
    groups = automatic_groups(llama, max_modules=64)
    assert groups is not None
    assert groups[5] == "model.layers.4" and groups[0] == "model.embed_tokens"
    assert groups[-2:] == ["model.norm", "lm_head"]

    yolo = [f"model.{i}.conv.weight" for i in range(23)] + ["model.23.cv2.0.0.conv.weight"]
    assert automatic_groups(yolo, max_modules=32) == [f"model.{i}" for i in range(24)]

    t5 = ["shared.weight"]
    for side in ("encoder", "decoder"):
        t5 += [f"{side}.block.{i}.layer.{j}.weight" for i in range(6) for j in range(3)]
        t5 += [f"{side}.final_layer_norm.weight"]
    groups = automatic_groups(t5, max_modules=32)
    assert groups is not None
    assert "encoder.block.5" in groups and "decoder.block.0" in groups
    assert "encoder.block.5.layer.2" not in groups  # inner repeats stay in their block
    assert "decoder.final_layer_norm" in groups and "shared" in groups


def test_automatic_groups_keep_moe_experts_inside_their_block() -> None:
    names = [f"model.layers.{i}.mlp.experts.{e}.w1" for i in range(4) for e in range(8)]
    groups = automatic_groups(names, max_modules=32)
    assert groups is not None and set(groups) == {f"model.layers.{i}" for i in range(4)}


def test_automatic_groups_merge_consecutive_blocks_within_max_modules() -> None:
    names = _nanogpt_names(48)
    groups = automatic_groups(names, max_modules=16)  # 4 stem/head groups leave 12 for blocks
    assert groups is not None
    assert len(set(groups)) <= 16
    by_name = dict(zip(names, groups, strict=True))
    assert by_name["transformer.h.0.ln_1.weight"] == "transformer.h.0-3"
    assert by_name["transformer.h.47.ln_1.weight"] == "transformer.h.44-47"
    assert by_name["lm_head.weight"] == "lm_head"


def test_automatic_groups_leave_a_model_without_repeated_blocks_to_top_level_modules() -> None:
    names = ["encoder.weight", "head.0.weight", "head.2.weight", "aux.1.weight", "bias"]
    assert automatic_groups(names, max_modules=32) is None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)


class _Gpt(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(16, 8),
                "h": nn.ModuleList(_Block() for _ in range(layers)),
                "ln_f": nn.LayerNorm(8),
            }  # fmt: skip
        )
        self.lm_head = nn.Linear(8, 16, bias=False)


def test_a_gpt_shaped_model_is_measured_by_block_with_the_default_depth() -> None:
    model = _Gpt(layers=6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    model.transformer.h[3].mlp.weight.grad = torch.full((8, 8), float("nan"))  # type: ignore[union-attr, index]
    probe = build_grad_probe(model.named_parameters(), optimizer, module_depth=0,
                             max_modules=32, limiter=LogLimiter())  # fmt: skip
    sample = probe.measure()
    assert sample is not None
    summary = probe.layout.summarize(torch.as_tensor(sample.packed).tolist())
    assert set(probe.groups) == {
        "transformer.wte", "transformer.ln_f", "lm_head", *(f"transformer.h.{i}" for i in range(6))
    }  # fmt: skip
    nonfinite = sorted(g for g, norm in summary.group_norms.items() if norm != norm)
    assert nonfinite == ["transformer.h.3"]
    assert probe.layout.nonfinite_offenders(summary) == ["transformer.h.3.mlp.weight"]


def test_an_explicit_depth_still_overrides_the_automatic_grouping() -> None:
    params = [(f"transformer.h.{i}.w", nn.Parameter(torch.zeros(2))) for i in range(6)]
    assert GradProbe(params, module_depth=1).groups == ("transformer",)
    assert GradProbe(params, module_depth=0).groups == tuple(f"transformer.h.{i}" for i in range(6))


def test_two_identical_blocks_are_a_stack_but_a_small_sequential_is_not() -> None:
    names = ["tok.weight", "blocks.0.attn.weight", "blocks.0.mlp.weight",
             "blocks.1.attn.weight", "blocks.1.mlp.weight", "head.weight"]  # fmt: skip
    shapes = [(64, 32), (32, 32), (128, 32), (32, 32), (128, 32), (64, 32)]
    assert automatic_groups(names, 32, shapes) == [
        "tok", "blocks.0", "blocks.0", "blocks.1", "blocks.1", "head"
    ]  # fmt: skip
    mlp = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    mlp_shapes = [(16, 8), (16,), (16, 16), (16,), (1, 16), (1,)]
    assert automatic_groups(mlp, 32, mlp_shapes) is None  # layers of different shapes


def test_a_wrapped_mlp_is_grouped_by_layer_below_the_wrappers_it_shares() -> None:
    # A LightningModule's self.model around a regressor's self.net (the Hugging Face Trainer's
    # model the same): depth 1 would be one group, "model", for the whole network.
    names = [f"model.net.{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias")]
    shapes = [(256, 32), (256,), (256, 256), (256,), (1, 256), (1,)]
    assert automatic_groups(names, 32, shapes) == [
        "model.net.0", "model.net.0", "model.net.2", "model.net.2", "model.net.4", "model.net.4"
    ]  # fmt: skip
    # The bare Sequential, and a model whose top level has several children, are unchanged.
    assert automatic_groups([name.removeprefix("model.net.") for name in names], 32, shapes) is None
    assert automatic_groups(["model.weight", "model.bias"], 32) is None  # one leaf module


def test_a_multi_layer_lstm_of_its_own_is_split_by_layer() -> None:
    lm = nn.ModuleDict(
        {"encoder": nn.Embedding(16, 8), "rnn": nn.LSTM(8, 8, 2), "decoder": nn.Linear(8, 16)}
    )
    names = [name for name, _ in lm.named_parameters()]
    groups = automatic_groups(names, 32, [tuple(p.shape) for p in lm.parameters()])
    assert groups is not None
    by_name = dict(zip(names, groups, strict=True))
    assert by_name["rnn.weight_hh_l1"] == "rnn.l1" and by_name["rnn.bias_ih_l0"] == "rnn.l0"
    assert by_name["encoder.weight"] == "encoder" and by_name["decoder.bias"] == "decoder"

    both = [name for name, _ in nn.LSTM(4, 4, 2, bidirectional=True).named_parameters()]
    assert set(automatic_groups([f"rnn.{n}" for n in both], 32) or []) == {"rnn.l0", "rnn.l1"}
    one_layer = [f"rnn.{name}" for name, _ in nn.LSTM(4, 4, 1).named_parameters()]
    assert automatic_groups([*one_layer, "head.weight"], 32) is None  # a layer is the module
    cells = ["lstm1.weight_ih", "lstm1.weight_hh", "lstm2.weight_ih", "linear.weight"]
    assert automatic_groups(cells, 32) is None  # LSTMCells are modules of their own already


def test_an_lstm_inside_a_repeated_block_stays_in_its_block() -> None:
    names = [f"layers.{i}.rnn.weight_ih_l{k}" for i in range(4) for k in (0, 1)]
    assert automatic_groups(names, 32) == [f"layers.{i}" for i in range(4) for _ in (0, 1)]


def test_the_lstm_language_model_is_measured_by_layer_with_the_default_depth() -> None:
    lm = nn.ModuleDict(
        {"encoder": nn.Embedding(16, 8), "rnn": nn.LSTM(8, 8, 2), "decoder": nn.Linear(8, 16)}
    )
    optimizer = torch.optim.SGD(lm.parameters(), lr=0.1)
    for param in lm.parameters():
        param.grad = torch.ones_like(param)
    lm["rnn"].weight_hh_l1.grad[0, 0] = float("nan")  # type: ignore[index]
    probe = build_grad_probe(lm.named_parameters(), optimizer, module_depth=0,
                             max_modules=32, limiter=LogLimiter())  # fmt: skip
    sample = probe.measure()
    assert sample is not None
    summary = probe.layout.summarize(torch.as_tensor(sample.packed).tolist())
    assert probe.groups == ("encoder", "rnn.l0", "rnn.l1", "decoder")
    assert sorted(g for g, norm in summary.group_norms.items() if norm != norm) == ["rnn.l1"]
    assert probe.layout.nonfinite_offenders(summary) == ["rnn.weight_hh_l1"]
