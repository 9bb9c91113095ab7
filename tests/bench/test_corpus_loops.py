"""The corpus loops of bench/corpus.py (gpt, lstm, cnn, and the real Lightning and Hugging Face
trainers with clipping on), scaled down for CI: each finds its LR blow-up within 2 steps with no
other anomaly, and exports the pre-clip norm; each NaN fault (a NaN in one parameter's
gradient once or at every step, a layer whose forward takes a log of zero) is found at its
step, in the planted parameter's module group, and the provenance of a fault that recurs
names its module. The leak and the 20,000-step clean runs are the bench's
(``python bench/corpus.py``); the trend rule's detection within 2,000 steps and its silence
on noise are proven on series in tests/detectors/test_trend.py, and one real leak run is the
slow test below."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import corpus  # noqa: E402 - bench/ is a directory of scripts, not a package

FAULT_STEP = 80
#: The real trainers warn about their own deprecations and CPU-only settings, as in
#: tests/integrations/test_framework_clipping.py; stabmon's own loops keep warnings as errors.
_TRAINER_WARNINGS = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
LOOPS = [
    pytest.param(loop, marks=_TRAINER_WARNINGS) if loop in ("lightning", "hf") else loop
    for loop in corpus.LOOPS
    if loop not in corpus.SHORT_RUNS  # the VAE and LBFGS loops have tests of their own below
]


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("loop", LOOPS)
def test_corpus_loop_finds_an_lr_blowup_within_two_steps_and_nothing_else(
    loop: str, tmp_path: Path
) -> None:
    outcome = corpus.run(loop, "lr_blowup", FAULT_STEP + 10, FAULT_STEP, str(tmp_path))
    assert outcome.false_positives == []
    assert outcome.detected_at is not None
    assert FAULT_STEP < outcome.detected_at <= FAULT_STEP + 2


#: The NaN faults need no warm-up: one shortly after the start, and the bench's short tail.
NAN_FAULT_STEP = 20
NAN_RUNS = [
    pytest.param(loop, fault, marks=_TRAINER_WARNINGS) if loop in ("lightning", "hf")
    else (loop, fault)
    for loop in corpus.LOOPS
    for fault in corpus.NAN_FAULTS
    if fault in corpus.LOOP_FAULTS[loop]
]  # fmt: skip


@pytest.mark.parametrize(("loop", "fault"), NAN_RUNS)
def test_corpus_loop_nan_fault_is_found_at_its_step_where_it_was_planted(
    loop: str, fault: str, tmp_path: Path
) -> None:
    # gpt: blocks.1.mlp.0 (clipping, accumulation of 4); lstm: the LSTM's second layer
    # (clip 0.25, SGD at lr 20); cnn: the second conv; lightning and hf: the regressor's
    # middle layer, under the LightningModule's and the HF model's own attribute (model.net.2).
    param, module, group = corpus.NAN_TARGETS[loop]
    steps = NAN_FAULT_STEP + corpus.NAN_TAIL
    outcome = corpus.run(loop, fault, steps, NAN_FAULT_STEP, str(tmp_path))
    assert outcome.false_positives == []
    assert outcome.detected_at == NAN_FAULT_STEP
    assert outcome.message is not None and f"at step {NAN_FAULT_STEP}" in outcome.message
    if fault != "nan_forward":  # the gradient check names the group, then the parameter
        assert outcome.named_modules == [group]
        assert outcome.named_parameters[:1] == [param]
        assert f"module group(s) {group} (first parameters {param})" in outcome.message
        assert outcome.provenance_step is not None
    if fault == "nan_grad":  # one backward's NaN, held back: the steps watched after are clean
        assert outcome.producer is None
    elif fault == "nan_backward":  # every backward's: placed at the parameter's module
        assert (outcome.producer, outcome.direction) == (param.rpartition(".")[0], "backward")
    else:  # every group upstream goes non-finite: the provenance names the producer
        assert group in outcome.named_modules
        assert (outcome.producer, outcome.direction) == (module, "forward")
        assert outcome.provenance_step is not None and outcome.provenance_step > NAN_FAULT_STEP
    assert outcome.ok


def test_corpus_nan_rows_say_the_group_and_the_producer(tmp_path: Path) -> None:
    outcome = corpus.run("cnn", "nan_forward", NAN_FAULT_STEP + corpus.NAN_TAIL,
                         NAN_FAULT_STEP, str(tmp_path))  # fmt: skip
    row = corpus.table([outcome]).splitlines()[-1]
    assert row.startswith("| nan_forward | step 20 (+0): features, classifier")  # model order
    assert row.endswith("producer features.3 (forward) |")


def test_corpus_refuses_a_fault_its_loop_cannot_carry(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lbfgs loop carries no nan_grad"):
        corpus.run("lbfgs", "nan_grad", 10, 5, str(tmp_path))


@pytest.mark.parametrize("loop", LOOPS)
def test_corpus_loop_exports_the_pre_clip_norm_of_its_last_step(loop: str, tmp_path: Path) -> None:
    outcome = corpus.run(loop, "clean", 60, 0, str(tmp_path))
    assert outcome.false_positives == []
    assert outcome.exported_grad_norm == pytest.approx(outcome.last_preclip_norm, rel=1e-5)


@pytest.mark.slow
def test_corpus_lstm_leak_is_flagged_within_two_thousand_steps() -> None:
    # Its own process, as a training script runs: the leak is judged on RSS, whose baseline
    # in a pytest worker is whatever the tests before it left (it hid the leak in CI).
    outcome = corpus.run_alone("lstm", "leak", 2600, 300)
    assert outcome.false_positives == []
    assert outcome.detected_at is not None and outcome.detected_at - 300 <= 2000


@pytest.mark.slow
def test_corpus_vae_short_run_flags_its_train_loss_leak_before_it_ends() -> None:
    """pytorch/examples' VAE, 300 steps, ``train_loss += loss`` (the tensor) from step 30, in
    a process of its own (see the LSTM leak above)."""
    outcome = corpus.run_alone("vae", "leak", 300, 30)
    assert outcome.false_positives == []
    assert outcome.detected_at is not None and 30 < outcome.detected_at < 300


@pytest.mark.slow
def test_corpus_lbfgs_loop_runs_clean_and_finds_its_lr_blowup(tmp_path: Path) -> None:
    """time_sequence_prediction: step(closure) with up to 25 passes a step, a prediction under
    no_grad() after each; an LR 1,000 times too large at step 3 blows the weights up."""
    clean = corpus.run("lbfgs", "clean", 4, 0, str(tmp_path / "clean"))
    assert clean.false_positives == []
    blowup = corpus.run("lbfgs", "lr_blowup", 5, 3, str(tmp_path / "blowup"))
    assert blowup.false_positives == [] and blowup.detected_at == 3


@pytest.mark.slow
def test_corpus_starving_loader_is_an_input_starvation_before_the_run_ends(tmp_path: Path) -> None:
    """Detection within a minute of the starvation's start is the bench's figure
    (``python bench/corpus.py --loops vae --faults starve``: these loops run on the real
    clock, so a test asserts only that it is found, and nothing else is)."""
    outcome = corpus.run("vae", "starve", 300, 30, str(tmp_path))
    assert outcome.false_positives == []
    assert outcome.detected_at is not None and 30 < outcome.detected_at < 300
