"""The copy task at the paper's settings (issue 42, item 1): the paper's generator against an independent checker,
its loss mask (the separator costs a perfect copier nothing) and the eval's breakdown against known copiers, RAdam
and the step schedule against the original algorithm, bf16 autocast, mid-stage checkpoints that resume exactly and
are scored while they run, GPT-2's attention against stock SDPA, the refusals of bad settings, and the copy-paper
preset's plan."""

import json
import math
import os
import subprocess
import sys
from copy import deepcopy

import pytest
import torch
from helpers import REPO_ROOT

import experiments.long_range.training as training
from experiments.long_range import load_preset, plan, run
from experiments.long_range.models import DECODER_FEATURE_MAPS, LABELS, Dims, build_decoder
from experiments.long_range.stages import checkpoint_file
from experiments.long_range.tasks import (
    COPY_VOCAB_SIZE, copy_batch, copy_paper_batch, copy_paper_lengths, copy_task_batch,
)
from experiments.long_range.training import (
    Checkpointing, check_optimizer, evaluate_copy, make_optimizer, train_copy,
)
from hf_linear_attn.training.errors import UsageError

PRESETS = REPO_ROOT / "configs" / "long_range"
TINY = Dims(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
RADAM = {"name": "radam", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "schedule": "step",
         "milestones": [3], "gamma": 0.1, "grad_clip": None}
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.98], "weight_decay": 0.01, "warmup_fraction": 0.1, "grad_clip": 1.0}


def check_sequence(ids: list[int], labels: list[int], length: int) -> int:
    """An independent reading of one sequence of the paper's task: m symbols (ids 3-12), the separator (0), the same
    m symbols, padding (1) to the end; labels equal to the ids on the separator and the copy, -100 elsewhere.
    Returns m."""
    assert len(ids) == len(labels) == length
    m = ids.index(0)
    assert length // 4 <= m <= (length - 1) // 2 - 1, m
    first, second, rest = ids[:m], ids[m + 1 : 2 * m + 1], ids[2 * m + 1 :]
    assert all(3 <= s <= 12 for s in first)
    assert second == first
    assert rest == [1] * len(rest)
    assert labels == [-100] * m + ids[m : 2 * m + 1] + [-100] * len(rest)
    return m


def test_the_papers_generator_is_seeded_and_every_sequence_checks_out_with_an_independent_checker():
    for length in (8, 128, 512):
        ids, labels = copy_paper_batch(400, length, torch.Generator().manual_seed(3))
        counts = [check_sequence(i, lab, length) for i, lab in zip(ids.tolist(), labels.tolist())]
        low, high = copy_paper_lengths(length)
        assert min(counts) == low and max(counts) == high  # the whole range is drawn, no more
        again = copy_paper_batch(400, length, torch.Generator().manual_seed(3))
        assert torch.equal(again[0], ids) and torch.equal(again[1], labels)
        assert not torch.equal(copy_paper_batch(400, length, torch.Generator().manual_seed(4))[0], ids)
    assert copy_paper_lengths(128) == (32, 62)  # the original: torch.randint(128 // 4, (128 - 1) // 2)
    symbols = copy_paper_batch(400, 128, torch.Generator().manual_seed(0))[0]
    assert set(symbols[symbols >= 3].unique().tolist()) == set(range(3, 13))  # all ten symbols, nothing else


class CopyOracle(torch.nn.Module):
    """A "model" that knows the paper's task: after each symbol of the first half it predicts the separator (nothing
    else is scored there), after the separator and each copied symbol the next symbol of the copy. `hedge` instead
    puts only 1 / (high + 1 - t) on the separator after t symbols, the chance that the sequence ends there."""

    def __init__(self, length: int, hedge: bool = False, wrong=lambda m, i: False):
        super().__init__()
        self.low, self.high, self.hedge, self.wrong = *copy_paper_lengths(length), hedge, wrong

    def forward(self, input_ids):
        batch, length = input_ids.shape
        logits = torch.full((batch, length, COPY_VOCAB_SIZE), -1e4, dtype=torch.float64)
        for row, ids in enumerate(input_ids.tolist()):
            m = ids.index(0)
            for t in range(length):
                if t < m:  # t + 1 symbols seen, no separator yet
                    p_end = 1.0 / (self.high + 1 - (t + 1)) if self.hedge and t + 1 >= self.low else 1.0
                    logits[row, t, 0] = math.log(p_end) if p_end > 0 else -1e4
                    if p_end < 1:
                        logits[row, t, 3:13] = math.log((1 - p_end) / 10)
                elif t < 2 * m:  # the next token is the copy's i-th symbol (i = t - m), wrong where asked
                    symbol = ids[t - m]
                    logits[row, t, 3 + (symbol - 2) % 10 if self.wrong(m, t - m) else symbol] = 0.0
        return type("Out", (), {"logits": logits})()


def test_the_separator_is_free_so_a_perfect_copier_scores_zero_loss():
    """The loss scores the separator only where it falls (the first half's other positions are not scored, as in
    the original's loss mask), so predicting it after every first-half symbol costs nothing: the eval loss can reach
    zero. The model that hedges on where the sequence ends, as if every position were scored, pays about 0.05
    nats a token at n = 128; GPT-2 trained below that, which is how this was found."""
    for length in (32, 128):
        exact = evaluate_copy(CopyOracle(length), length, 64, 2, 0, "paper")
        assert exact["eval_loss"] < 1e-9 and exact["eval_token_accuracy"] == 1.0 and exact["eval_copy_loss"] < 1e-9
        hedged = evaluate_copy(CopyOracle(length, hedge=True), length, 64, 2, 0, "paper")
        assert hedged["eval_copy_loss"] < 1e-9 and hedged["eval_loss"] > 0.03


def test_the_copy_accuracy_is_broken_down_by_the_number_of_symbols_and_the_place_in_the_copy():
    """A copier that fails exactly the first quarter of every copy, and one that fails every sequence of 56 symbols
    or more: the breakdown puts the errors in those bins and nowhere else (n = 128: m from 32 to 62, 31 lengths
    in bins of 8, 8, 8 and 7)."""
    first_quarter = evaluate_copy(CopyOracle(128, wrong=lambda m, i: 4 * i < m), 128, 64, 2, 0, "paper")
    assert first_quarter["eval_copy_accuracy_by_place"] == {"quarter 1": 0.0, "quarter 2": 1.0, "quarter 3": 1.0,
                                                            "quarter 4": 1.0}
    assert all(0.6 < acc < 0.9 for acc in first_quarter["eval_copy_accuracy_by_length"].values())
    long = evaluate_copy(CopyOracle(128, wrong=lambda m, i: m >= 56), 128, 64, 2, 0, "paper")
    assert long["eval_copy_accuracy_by_length"] == {"m 32-39": 1.0, "m 40-47": 1.0, "m 48-55": 1.0, "m 56-62": 0.0}
    assert all(0.5 < acc < 0.9 for acc in long["eval_copy_accuracy_by_place"].values())
    assert long["eval_separator_accuracy"] == 1.0 and long["eval_separator_loss"] < 1e-9
    total = first_quarter["eval_copy_accuracy"]
    assert 0.7 < total < 0.8  # about three quarters of the copied tokens right


@pytest.mark.parametrize("name", ["gpt2_sdpa", "linear_gpt2"])
def test_padding_and_the_first_half_count_for_nothing_in_the_loss(name):
    torch.manual_seed(0)
    model = build_decoder(name, TINY, 32, COPY_VOCAB_SIZE).eval()
    ids, labels = copy_paper_batch(4, 32, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        logits, target = out.logits[:, :-1], labels[:, 1:]
        keep = target != -100
        by_hand = torch.nn.functional.cross_entropy(logits[keep], target[keep])
        torch.testing.assert_close(out.loss, by_hand)
        other = ids.clone()
        other[ids == 1] = 7  # other tokens where the padding was: the scored predictions cannot see them
        torch.testing.assert_close(model(input_ids=other, labels=labels).loss, out.loss)


def reference_radam(params, grads_per_step, lr_per_step, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """RAdam as Liu et al.'s original code (the optimizer the paper's copy example imports) updates, written out:
    decoupled weight decay p -= wd * lr * p, the rectified Adam step once N_sma >= 5, SGD with momentum before."""
    beta1, beta2 = betas
    params = [p.detach().clone().double() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    n_sma_max = 2 / (1 - beta2) - 1
    for t, (grads, lr) in enumerate(zip(grads_per_step, lr_per_step), 1):
        for i, g in enumerate(grads):
            g = g.double()
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m[i] = beta1 * m[i] + (1 - beta1) * g
            beta2_t = beta2**t
            n_sma = n_sma_max - 2 * t * beta2_t / (1 - beta2_t)
            params[i] = params[i] - weight_decay * lr * params[i]
            if n_sma >= 5:
                r = math.sqrt((1 - beta2_t) * (n_sma - 4) / (n_sma_max - 4) * (n_sma - 2) / n_sma
                              * n_sma_max / (n_sma_max - 2))
                params[i] = params[i] - lr * r / (1 - beta1**t) * m[i] / (v[i].sqrt() + eps)
            else:
                params[i] = params[i] - lr / (1 - beta1**t) * m[i]
    return params


def test_radam_and_the_step_schedule_update_as_the_original_code():
    """Ten updates (the first five in RAdam's SGD phase), the lr cut by 10 after 3 updates, as the paper's example
    cuts it after 3,000: make_optimizer's parameters equal the written-out algorithm's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer, scheduler = make_optimizer(model, RADAM, steps=10)
    grads, lrs = [], []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        loss = model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1e-3] * 3 + [1e-4] * 7)
    expected = reference_radam(start, grads, lrs)
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)


def test_the_fixed_task_with_adamw_trains_exactly_as_before_the_paper_options():
    """The code before this option, written out (AdamW on matrices, warm-up then linear decay, clip 1.0, the fixed
    `sep x sep x` batches): the same curve and weights as train_copy's default path."""
    def old_loop(model, steps):
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-3, betas=(0.9, 0.98), eps=1e-8)
        warmup = max(1, int(0.1 * steps))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup)))
        generator, losses = torch.Generator().manual_seed(0), []
        for _ in range(steps):
            ids, labels = copy_batch(2, 16, generator)
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    old = build_decoder("gpt2_sdpa", TINY, 16, COPY_VOCAB_SIZE)
    losses = old_loop(old, 4)
    torch.manual_seed(0)
    new = build_decoder("gpt2_sdpa", TINY, 16, COPY_VOCAB_SIZE)
    trained = train_copy(new, 16, 4, 2, ADAMW, 0, 1)
    assert [loss for _, loss in trained["loss_curve"]] == losses
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))


class Killed(BaseException):
    """Stands for the kill of a session's end: nothing after it runs."""


def killed_after(batches: int, monkeypatch):
    """Make the copy task's batch source die when asked for batch number `batches` + 1."""
    calls = [0]
    real = training.copy_task_batch

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] > batches:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "copy_task_batch", dying)


@pytest.mark.parametrize("name", ["gpt2_sdpa", "reformer_lsh"])  # dropout masks; LSH's random rotations
def test_a_stage_killed_after_a_checkpoint_resumes_to_the_same_curve_and_weights_as_one_never_stopped(
        name, tmp_path, monkeypatch):
    args = {"model": name, "steps": 8}
    common = dict(length=32, steps=8, batch_size=4, optim=RADAM, seed=0, log_every=2, variant="paper")

    def fresh():
        torch.manual_seed(0)
        return build_decoder(name, TINY, 32, COPY_VOCAB_SIZE, dropout=0.1)

    straight_model = fresh()
    straight = train_copy(straight_model, **common)

    path = tmp_path / "stage.pt"
    with monkeypatch.context() as patch:
        killed_after(7, patch)  # checkpoints after steps 3 and 6; killed while asking for step 8's batch
        with pytest.raises(Killed):
            train_copy(fresh(), **common, checkpointing=Checkpointing(path, 3, args))
    assert torch.load(path, weights_only=True)["step"] == 6
    assert not list(tmp_path.glob(".*.tmp"))  # the temp files were renamed into place
    told = []
    resumed_model = fresh()
    resumed = train_copy(resumed_model, **common, checkpointing=Checkpointing(path, 3, args, log=told.append))
    assert told[0] == "resuming from the checkpoint at step 6 of 8" and resumed["resumed_at"] == [6]
    assert resumed["loss_curve"] == straight["loss_curve"] and len(straight["loss_curve"]) == 4
    for key in ("eval_loss", "eval_token_accuracy", "eval_copy_loss", "eval_copy_accuracy"):
        assert resumed[key] == straight[key], key
    for (k, a), b in zip(straight_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(UsageError, match=r"other arguments \(changed: steps\).*delete it"):
        train_copy(fresh(), **common, checkpointing=Checkpointing(path, 3, {**args, "steps": 9}))


def write_tiny_copy_preset(path):
    """copy-paper at tiny dims: GPT-2 alone, 6 steps of 2 sequences of 32, a checkpoint every 2 steps, the lr drop at
    step 3 (so the schedule does not depend on the number of steps)."""
    preset = json.loads((PRESETS / "copy-paper.json").read_text())
    preset["tasks"]["copy"].update(dims=TINY.__dict__, settings=[{"length": 32, "steps": 6, "batch_size": 2}],
                                   models=["gpt2_sdpa"], checkpoint_every=2, log_every=1)
    preset["optimizer"]["milestones"] = [3]
    path.write_text(json.dumps(preset))


def test_the_runner_resumes_a_killed_stage_mid_way_and_drops_its_checkpoint_once_recorded(tmp_path, monkeypatch):
    write_tiny_copy_preset(tmp_path / "tiny.json")
    quiet = dict(log=lambda s: None, argv=[])
    run(tmp_path / "tiny.json", tmp_path / "straight", **quiet)
    for sitting in range(2):  # killed at step 3, then at step 5 of the resumed run: checkpoints at steps 2 and 4
        with monkeypatch.context() as patch:
            killed_after(3, patch)
            with pytest.raises(Killed):
                run(tmp_path / "tiny.json", tmp_path / "resumed", **quiet)
        if sitting == 0:
            run(tmp_path / "tiny.json", tmp_path / "resumed", report_only=True, eval_running=True, **quiet)
    assert checkpoint_file(tmp_path / "resumed", "copy-n32/gpt2_sdpa").is_file()
    assert not (tmp_path / "resumed" / "records.json").is_file()
    # while it is stopped (or running), the report shows the stage's curve so far from its checkpoint
    run(tmp_path / "tiny.json", tmp_path / "resumed", report_only=True, **quiet)
    straight = json.loads((tmp_path / "straight" / "records.json").read_text())["copy-n32/gpt2_sdpa"]["metrics"]
    partial = (tmp_path / "resumed" / "results.md").read_text()
    assert "## Copy task in progress" in partial and "stages finished: 0 of 1" in partial
    assert f"| 32 | {LABELS['gpt2_sdpa']} | 4 | 6 | {dict(straight['loss_curve'])[4]:.4f} (step 4) |" in partial
    assert "Held-out scores" not in partial
    # --eval_running scores the checkpoint as a stage stopped at step 4 is scored when it finishes (the schedule's
    # milestone does not depend on the steps, so a 4-step run trains the same weights)
    four = json.loads((tmp_path / "tiny.json").read_text())
    four["tasks"]["copy"]["settings"][0]["steps"] = 4
    (tmp_path / "four.json").write_text(json.dumps(four))
    run(tmp_path / "four.json", tmp_path / "four", **quiet)
    at_four = json.loads((tmp_path / "four" / "records.json").read_text())["copy-n32/gpt2_sdpa"]["metrics"]
    run(tmp_path / "tiny.json", tmp_path / "resumed", report_only=True, eval_running=True, **quiet)
    scores = json.loads((tmp_path / "resumed" / "checkpoints" / "copy-n32__gpt2_sdpa.eval.json").read_text())
    assert scores["step"] == 4 and scores["metrics"] == {k: v for k, v in at_four.items() if k.startswith("eval_")}
    assert [h[0] for h in scores["history"]] == [2, 4]
    assert scores["history"][1] == [4, at_four["eval_loss"], at_four["eval_copy_accuracy"]]
    partial = (tmp_path / "resumed" / "results.md").read_text()
    assert (f"| 32 | {LABELS['gpt2_sdpa']} | 4 | {at_four['eval_loss']:.4f} | "
            f"{100 * at_four['eval_token_accuracy']:.2f} | {at_four['eval_copy_loss']:.4f} |") in partial
    assert (f"step 4 {at_four['eval_loss']:.4f} ({100 * at_four['eval_copy_accuracy']:.2f})" in partial
            and "step 2 " in partial)
    run(tmp_path / "tiny.json", tmp_path / "resumed", report_only=True, **quiet)  # kept for later reports
    assert "Held-out scores" in (tmp_path / "resumed" / "results.md").read_text()
    run(tmp_path / "tiny.json", tmp_path / "resumed", **quiet)
    assert not checkpoint_file(tmp_path / "resumed", "copy-n32/gpt2_sdpa").is_file()
    assert not (tmp_path / "resumed" / "checkpoints" / "copy-n32__gpt2_sdpa.eval.json").is_file()
    assert "## Copy task in progress" not in (tmp_path / "resumed" / "results.md").read_text()
    straight, resumed = (json.loads((tmp_path / d / "records.json").read_text())["copy-n32/gpt2_sdpa"]["metrics"]
                         for d in ("straight", "resumed"))
    assert resumed["resumed_at"] == [2, 4] and "resumed_at" not in straight
    # the scored checkpoints stay in the record as its eval curve, ending with the stage's own score
    assert [h[0] for h in resumed["eval_history"]] == [2, 4, 6] and "eval_history" not in straight
    assert resumed["eval_history"][1] == scores["history"][1]
    assert resumed["eval_history"][2] == [6, resumed["eval_loss"], resumed["eval_copy_accuracy"]]
    assert resumed["loss_curve"] == straight["loss_curve"] and resumed["eval_loss"] == straight["eval_loss"]
    assert "| resumed at steps |" in (tmp_path / "resumed" / "results.md").read_text()


def test_a_device_the_copy_task_cannot_use_is_refused_before_any_work(tmp_path):
    quiet = {"log": lambda s: None, "argv": []}
    with pytest.raises(UsageError, match="--device 'mps': use 'cpu'"):
        run(PRESETS / "copy-paper.json", tmp_path, device="mps", **quiet)
    with pytest.raises(UsageError, match="copy task only; the slice also holds efficiency, listops, text: add --tas"):
        run(PRESETS / "cpu.json", tmp_path, device="cuda", **quiet)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device here"):
            run(PRESETS / "copy-paper.json", tmp_path, device="cuda", **quiet)
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: scripts/gpu_check.sh runs it")
def test_a_copy_stage_trains_on_cuda_and_resumes_exactly_there(tmp_path, monkeypatch):
    """On a GPU: the stage trains there (the record names the device), and a kill and a resume give the curve and
    eval of a run never stopped (the GPU's dropout generator is checkpointed with the others)."""
    write_tiny_copy_preset(tmp_path / "tiny.json")
    quiet = {"log": lambda s: None, "argv": [], "device": "cuda"}
    run(tmp_path / "tiny.json", tmp_path / "straight", **quiet)
    with monkeypatch.context() as patch:
        killed_after(5, patch)
        with pytest.raises(Killed):
            run(tmp_path / "tiny.json", tmp_path / "resumed", **quiet)
    run(tmp_path / "tiny.json", tmp_path / "resumed", **quiet)
    straight, resumed = (json.loads((tmp_path / d / "records.json").read_text())["copy-n32/gpt2_sdpa"]["metrics"]
                         for d in ("straight", "resumed"))
    assert straight["device"].startswith("cuda: ") and resumed["resumed_at"] == [4]
    assert f"({straight['device']}) |" in (tmp_path / "straight" / "results.md").read_text()
    assert resumed["loss_curve"] == straight["loss_curve"] and resumed["eval_loss"] == straight["eval_loss"]


def test_bf16_autocasts_the_forward_and_keeps_float32_weights():
    torch.manual_seed(0)
    model = build_decoder("linear_gpt2", TINY, 32, COPY_VOCAB_SIZE)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    trained = train_copy(model, 32, 2, 2, RADAM, 0, 1, variant="paper", precision="bf16")
    assert seen[:2] == [torch.bfloat16] * 2 and seen[-1] == torch.float32  # training autocast, evaluation not
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(math.isfinite(loss) for _, loss in trained["loss_curve"])


def test_the_decoders_with_other_feature_maps_run_them():
    for name, feature_map in DECODER_FEATURE_MAPS.items():
        model = build_decoder(name, TINY, 32, COPY_VOCAB_SIZE)
        assert model.config.feature_map == feature_map, name
        scores = evaluate_copy(model, 32, 2, 1, 0, "paper")
        assert math.isfinite(scores["eval_loss"]) and math.isfinite(scores["eval_copy_loss"])


@pytest.mark.parametrize("change, message", [
    (lambda p: p["tasks"]["copy"]["settings"][0].update(length=6), "at least 8"),
    (lambda p: p["tasks"]["copy"].update(variant="random"), "unknown copy task variant 'random'"),
    (lambda p: p["tasks"]["copy"].update(precision="fp16"), "unknown precision 'fp16'.*'bf16'"),
    (lambda p: p["tasks"]["copy"].update(checkpoint_every=0), "'checkpoint_every' must be a positive"),
    (lambda p: p["tasks"]["copy"].update(activation="swish"), "unknown activation 'swish'.*gelu_pytorch_tanh"),
    (lambda p: p["tasks"]["copy"].update(dropout=1.5), r"'dropout' must lie in \[0, 1\)"),
    (lambda p: p["optimizer"].update(name="lamb"), "unknown optimizer name 'lamb': use 'adamw'.*'radam'"),
    (lambda p: p["optimizer"].update(schedule="cosine"), "unknown optimizer schedule 'cosine'"),
    (lambda p: p["optimizer"].pop("milestones"), "schedule 'step' needs 'milestones'"),
    (lambda p: p["optimizer"].update(milestones=[3000, 100]), "schedule 'step' needs 'milestones', a rising"),
    (lambda p: p["optimizer"].update(gamma=0), "needs 'gamma' in"),
    (lambda p: p["optimizer"].update(grad_clip=-1), "'grad_clip' must be a positive number, or null"),
])
def test_bad_copy_settings_are_refused_naming_the_fix(change, message, tmp_path):
    preset = json.loads((PRESETS / "copy-paper.json").read_text())
    change(preset)
    (tmp_path / "bad.json").write_text(json.dumps(preset))
    with pytest.raises(UsageError, match=message):
        load_preset(tmp_path / "bad.json")


def test_a_bad_length_is_refused_by_the_generators_too():
    with pytest.raises(UsageError, match="at least 8"):
        copy_paper_batch(2, 7, torch.Generator())
    with pytest.raises(UsageError, match="even and at least 4"):
        copy_task_batch("fixed", 2, 7, torch.Generator())
    with pytest.raises(UsageError, match="unknown optimizer name"):
        check_optimizer({"name": "sgd", "lr": 0.1})


def test_the_copy_paper_preset_validates_and_plans_the_papers_settings_in_the_issues_order():
    preset = load_preset(PRESETS / "copy-paper.json")
    stages = plan(preset)
    assert [s.key for s in stages[:2]] == ["copy-n128/linear_gpt2", "copy-n128/gpt2_sdpa"]
    lengths = [s.args["length"] for s in stages]
    assert lengths == sorted(lengths) and set(lengths) == {128, 512}
    assert {s.args["model"] for s in stages} == {"gpt2_sdpa", "linear_gpt2", "linformer_gpt2", "reformer_lsh",
                                                 *DECODER_FEATURE_MAPS}
    for stage in stages:
        a = stage.args
        assert a["dims"] == {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "intermediate_size": 1024}
        assert (a["steps"], a["batch_size"], a["variant"]) == (20000, 64, "paper")
        assert a["optimizer"]["name"] == "radam" and a["optimizer"]["lr"] == 1e-3
        assert (a["optimizer"]["milestones"], a["optimizer"]["gamma"]) == ([3000], 0.1)
        assert stage.options == {"checkpoint_every": 100}
        assert (a["precision"], a["activation"]) == ("bf16", "gelu_pytorch_tanh")


@pytest.mark.parametrize("name", ["gpt2_sdpa", "linear_gpt2", "linformer_gpt2"])
def test_the_fused_activation_is_gpt2s_gelu_up_to_rounding(name):
    """"gelu_pytorch_tanh" (the copy-paper preset's, one fused kernel) sets the decoder's feed-forward activation and
    computes the function GPT-2's default "gelu_new" does: the same weights give the same logits within float32
    rounding; an activation outside the list is refused."""
    torch.manual_seed(0)
    default = build_decoder(name, TINY, 32, COPY_VOCAB_SIZE).eval()
    fused = build_decoder(name, TINY, 32, COPY_VOCAB_SIZE, activation="gelu_pytorch_tanh").eval()
    fused.load_state_dict(default.state_dict())
    assert (default.config.activation_function, fused.config.activation_function) == ("gelu_new",
                                                                                      "gelu_pytorch_tanh")
    assert [type(block.mlp.act).__name__ for block in fused.transformer.h] == ["GELUTanh"] * TINY.num_layers
    ids, _ = copy_task_batch("paper", 2, 32, torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused(ids).logits, default(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(UsageError, match="unknown activation 'relu'"):
        build_decoder(name, TINY, 32, COPY_VOCAB_SIZE, activation="relu")


def test_gpt2s_attention_is_sdpa_with_the_kernel_in_float32_under_bf16_on_the_cpu(monkeypatch):
    """The copy-task GPT-2 runs transformers' SDPA attention, except that under bf16 autocast on the CPU the kernel
    gets float32 queries, keys and values (its bf16 CPU kernel is the slower). Against stock SDPA GPT-2 with the same
    weights: equal logits in float32, with and without padding (SDPA's own masks); under bf16 autocast the kernel sees
    float32 only, and the logits are at least as close to float32's as stock SDPA's bf16 logits (plus rounding)."""
    import transformers as tf

    from experiments.long_range.models import GPT2_ATTENTION

    torch.manual_seed(0)
    ours = build_decoder("gpt2_sdpa", TINY, 32, COPY_VOCAB_SIZE).eval()
    stock = tf.GPT2LMHeadModel._from_config(deepcopy(ours.config), attn_implementation="sdpa").eval()
    stock.load_state_dict(ours.state_dict())
    assert (ours.config._attn_implementation, stock.config._attn_implementation) == (GPT2_ATTENTION, "sdpa")
    ids, _ = copy_task_batch("paper", 3, 32, torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # a padded row: the mask must reach the kernel as SDPA's would
    for kwargs in ({}, {"attention_mask": mask}):
        assert torch.equal(ours(ids, **kwargs).logits, stock(ids, **kwargs).logits)
    reference = stock(ids, attention_mask=mask).logits.double()

    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours_bf16 = ours(ids, attention_mask=mask).logits.double()
        calls = len(seen)
        stock_bf16 = stock(ids, attention_mask=mask).logits.double()
    assert calls == TINY.num_layers and set(seen[:calls]) == {(torch.float32,) * 3}
    assert set(seen[calls:]) == {(torch.bfloat16,) * 3}  # stock SDPA under autocast: the bf16 kernel
    ours_error, stock_error = ((x - reference).abs().max().item() for x in (ours_bf16, stock_bf16))
    assert ours_error <= 1.25 * stock_error + 1e-3, (ours_error, stock_error)


@pytest.mark.slow
def test_the_copy_paper_preset_dry_runs_from_the_command_line():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "long_range.py"), "--preset", "copy-paper",
                           "--dry_run"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "14 stages" and lines[0].startswith("copy-n128/linear_gpt2: ")
    assert json.loads(lines[0].split(": ", 1)[1])["variant"] == "paper"
    assert lines[1] == '    runs with {"checkpoint_every": 100}'
