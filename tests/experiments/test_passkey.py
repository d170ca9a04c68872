"""Passkey retrieval (issue 42, item 3): the generator against its independent evaluator on real WikiText-2 filler,
refusals with the fix, the answer-only loss, and the runner end to end through scripts/recall.py."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import ENV, REPO_ROOT, WIKITEXT, data_missing

from experiments.recall.passkey import (
    check_passkey_example, check_passkey_settings, load_filler, min_passkey_length, passkey_batch, passkey_example,
    passkey_parts,
)
from experiments.recall.passkey_runner import load_preset, plan
from hf_linear_attn.training.errors import UsageError

# the real data may be missing on a user's machine, never in CI
needs_wikitext = pytest.mark.skipif(data_missing(WIKITEXT / "wiki.train.tokens"),
                                    reason=f"WikiText-2 not found at {WIKITEXT} (see ../shared/data/README.md)")
PRESETS = REPO_ROOT / "configs" / "recall"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE as the runner trains one (GPT-2 style), on 2,000 lines of WikiText-2 train: a second."""
    from hf_linear_attn.training.data import train_bpe_tokenizer

    with (WIKITEXT / "wiki.train.tokens").open(encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for _, line in zip(range(4000), handle) if line.strip()]
    return train_bpe_tokenizer(lines, 2000, "gpt2", 4096)


@pytest.fixture(scope="module")
def filler(tokenizer):
    return load_filler(WIKITEXT / "wiki.valid.tokens", tokenizer, max_tokens=30_000)


@needs_wikitext
@pytest.mark.parametrize("length", [64, 512, 1024, 4096])
def test_generated_examples_pass_the_independent_evaluator_and_are_seeded(tokenizer, filler, length):
    for seed in (0, 1, 2):
        for depth in (0.1, 0.5, 0.9, (0.1, 0.9)):
            ids, labels, examples = passkey_batch(3, length, filler, tokenizer, torch.Generator().manual_seed(seed),
                                                  depth, digits=5)
            assert ids.shape == labels.shape == (3, length)
            for row, example in zip(range(3), examples):
                check_passkey_example(ids[row].tolist(), labels[row].tolist(), tokenizer, length, example.depth,
                                      example.key, 5)
                assert example.depth == depth or depth[0] <= example.depth <= depth[1]
                assert sum(example.answer_digits) == 5
            again, again_labels, _ = passkey_batch(3, length, filler, tokenizer, torch.Generator().manual_seed(seed),
                                                   depth, digits=5)
            assert torch.equal(ids, again) and torch.equal(labels, again_labels)


@needs_wikitext
def test_keys_written_one_digit_per_token_pass_the_evaluator_and_read_as_the_same_text(tokenizer, filler):
    for seed, depth, length in ((0, 0.1, 256), (1, 0.9, 1024), (2, (0.05, 0.95), 512)):
        ids, labels, examples = passkey_batch(4, length, filler, tokenizer, torch.Generator().manual_seed(seed),
                                              depth, key_tokens="digits")
        _, _, bpe = passkey_batch(4, length, filler, tokenizer, torch.Generator().manual_seed(seed), depth)
        assert examples[0].key == bpe[0].key  # the key is drawn first, whichever way it is written
        for row, example in enumerate(examples):
            check_passkey_example(ids[row].tolist(), labels[row].tolist(), tokenizer, length, example.depth,
                                  example.key, 5, key_tokens="digits")
            assert example.answer_digits == [1] * 5
            assert example.bpe_digits == passkey_parts(tokenizer, example.key).answer_digits  # the other writing
            text = tokenizer.decode(ids[row].tolist())
            assert text.count(f" The pass key is {example.key}. Remember it.") == 1
            assert text.endswith(f"What is the pass key? The pass key is {example.key}")
    # the evaluator tells the two writings apart: a key the tokenizer writes in fewer tokens is no digit-per-token key
    e = next(e for e in bpe if len(e.answer_digits) < 5)
    with pytest.raises(AssertionError, match="not one digit each"):
        check_passkey_example(e.input_ids, e.labels, tokenizer, len(e.input_ids), e.depth, e.key, 5,
                              key_tokens="digits")


@needs_wikitext
def test_the_key_sits_where_the_depth_says_and_keys_differ(tokenizer, filler):
    g = torch.Generator().manual_seed(3)
    shallow = passkey_example(filler, tokenizer, 1024, 0.1, g)
    deep = passkey_example(filler, tokenizer, 1024, 0.9, g)
    assert shallow.key != deep.key
    assert shallow.key_start < 0.15 * 1024 and deep.key_start > 0.8 * 1024
    assert deep.question_start < deep.answer_start == 1024 - len(deep.answer_digits)
    # the text says the key once, then asks for it
    text = tokenizer.decode(deep.input_ids)
    assert text.count(deep.key) == 2 and text.endswith(f"What is the pass key? The pass key is {deep.key}")


@needs_wikitext
def test_the_evaluator_catches_a_wrong_key_a_moved_sentence_a_second_key_and_a_wrong_length(tokenizer, filler):
    e = passkey_example(filler, tokenizer, 256, 0.5, torch.Generator().manual_seed(0))
    check_passkey_example(e.input_ids, e.labels, tokenizer, 256, 0.5, e.key, 5)
    wrong = str(int(e.key) + 1) if e.key != "99999" else "10000"
    with pytest.raises(AssertionError, match="decodes to"):
        check_passkey_example(e.input_ids, e.labels, tokenizer, 256, 0.5, wrong, 5)
    with pytest.raises(AssertionError, match="not at depth 0.2"):
        check_passkey_example(e.input_ids, e.labels, tokenizer, 256, 0.2, e.key, 5)
    with pytest.raises(AssertionError, match="expected 257"):
        check_passkey_example(e.input_ids, e.labels, tokenizer, 257, 0.5, e.key, 5)
    twice = list(e.input_ids)
    answer = passkey_parts(tokenizer, e.key).answer
    twice[5 : 5 + len(answer)] = answer  # the key's digits once more in the filler
    with pytest.raises(AssertionError, match="more than once"):
        check_passkey_example(twice, e.labels, tokenizer, 256, 0.5, e.key, 5)
    unlabelled = list(e.labels)
    unlabelled[-1] = -100
    with pytest.raises(AssertionError, match="one span at the end"):
        check_passkey_example(e.input_ids, unlabelled, tokenizer, 256, 0.5, e.key, 5)


@needs_wikitext
def test_bad_settings_are_refused_with_the_reason_and_the_fix(tokenizer, filler):
    g = torch.Generator()
    for depth in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(UsageError, match="strictly between 0 and 1"):
            passkey_example(filler, tokenizer, 256, depth, g)
    shortest = min_passkey_length(tokenizer, 5)
    with pytest.raises(UsageError, match=f"too short.*use lengths >= {shortest}"):
        check_passkey_settings(tokenizer, [shortest - 1, 512], [0.5], 5)
    check_passkey_settings(tokenizer, [shortest, 512], [0.5], 5)
    with pytest.raises(UsageError, match="too short"):
        passkey_example(filler, tokenizer, 30, 0.5, g)
    with pytest.raises(UsageError, match="filler text holds 100 tokens.*raise filler_max_tokens"):
        passkey_example(filler[:100], tokenizer, 512, 0.5, g)
    with pytest.raises(UsageError, match="1 to 18 digits"):
        passkey_example(filler, tokenizer, 512, 0.5, g, digits=0)
    with pytest.raises(UsageError, match="no filler text at"):
        load_filler(WIKITEXT / "wiki.missing.tokens", tokenizer)


class PieceTokenizer:
    """A stand-in tokenizer that cuts text into the given pieces, longest first, one id per piece ("?" for a character
    no piece holds): the tokenizers a user might bring, in miniature."""

    def __init__(self, pieces):
        self.pieces = ["?", *sorted(set(pieces) | set(" abcdefghijklmnopqrstuvwxyzTRW?."), key=len, reverse=True)]

    def __call__(self, text, add_special_tokens=False):
        ids = []
        while text:
            found = next((i for i, piece in enumerate(self.pieces) if piece != "?" and text.startswith(piece)), 0)
            ids.append(found)
            text = text[len(self.pieces[found]) if found else 1 :]
        return {"input_ids": ids}

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_a_tokenizer_that_splits_the_digits_unexpectedly_is_refused():
    digits = [str(d) for d in range(10)]
    # per-digit tokens after a lone space (SentencePiece-like): fine, the space carries no digit
    spaced = passkey_parts(PieceTokenizer(digits), "12345")
    assert spaced.answer_digits == [0, 1, 1, 1, 1, 1]
    assert passkey_parts(PieceTokenizer([*digits, " 12", "345"]), "12345").answer_digits == [2, 3]
    # the last digit glued to the full stop inside the sentence: the answer's tokens are not the context's
    with pytest.raises(UsageError, match="differently inside the key sentence"):
        passkey_parts(PieceTokenizer([*digits, "5."]), "12345")
    # a digit the vocabulary lacks: the answer does not decode to the key
    with pytest.raises(UsageError, match="does not give the key back"):
        passkey_parts(PieceTokenizer([d for d in digits if d != "9"]), "19999")
    # one digit per token: the first with its space, inside the sentence as after the question
    per_digit = PieceTokenizer([*digits, *(" " + d for d in digits), " 12", "345"])
    parts = passkey_parts(per_digit, "12345", "digits")
    assert parts.answer_digits == [1] * 5 and per_digit.convert_ids_to_tokens(parts.answer) == [" 1", *"2345"]
    assert per_digit.decode(parts.sentence) == " The pass key is 12345. Remember it."
    with pytest.raises(UsageError, match="key_tokens 'digits' needs a token for each digit"):
        passkey_parts(PieceTokenizer(digits), "12345", "digits")  # no " 1": a lone space, then the digits
    with pytest.raises(UsageError, match="key_tokens must be 'bpe'.*or 'digits'"):
        passkey_parts(per_digit, "12345", "words")


@needs_wikitext
def test_the_answer_only_loss_equals_the_models_own_loss_and_scores_count_digits(tokenizer, filler):
    from experiments.long_range.models import Dims
    from experiments.recall.models import build_recall_model
    from experiments.recall.training import AnswerTokensLoss, evaluate_passkey

    ids, labels, examples = passkey_batch(2, 96, filler, tokenizer, torch.Generator().manual_seed(0), 0.5)
    for name in ("gpt2_sdpa", "linear_gpt2_gated_conv"):
        torch.manual_seed(0)
        model = build_recall_model(name, Dims(32, 1, 2, 64), 96, len(tokenizer)).eval()
        with torch.no_grad():
            torch.testing.assert_close(AnswerTokensLoss(model)(input_ids=ids, labels=labels).loss,
                                       model(input_ids=ids, labels=labels).loss)
        score = evaluate_passkey(model, [(ids, labels, examples)])
        assert score["examples"] == 2 and 0 <= score["exact_match"] <= score["digit_accuracy"] <= 1


@needs_wikitext
def test_the_score_records_each_key_and_which_tokens_a_model_got_wrong(tokenizer, filler):
    """evaluate_passkey's per-key record against a model whose answers are known: it predicts every next token right
    (the one-hot of the true next token) except the tokens the test spoils; and the report's split by tokenization
    against a count made here."""
    from experiments.recall.passkey_runner import misses_by_token
    from experiments.recall.training import evaluate_passkey

    ids, labels, examples = passkey_batch(6, 128, filler, tokenizer, torch.Generator().manual_seed(3), 0.5)
    spoil = {1: [0], 4: [len(examples[4].answer_digits) - 1], 5: list(range(len(examples[5].answer_digits)))}

    class Oracle(torch.nn.Module):  # the hidden state at t is the one-hot of token t + 1; lm_head passes it through
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Identity()

        def base_model(self, input_ids):
            following = torch.roll(input_ids, -1, dims=1).clone()
            first = next(r for r in range(len(ids)) if torch.equal(ids[r], input_ids[0]))  # the batch's first row
            for row, tokens in spoil.items():
                if first <= row < first + len(input_ids):
                    for t in tokens:  # position answer - 1 + t predicts the answer's token t
                        at = examples[row].answer_start - 1 + t
                        following[row - first, at] = (following[row - first, at] + 1) % len(tokenizer)
            return type("Out", (), {"last_hidden_state": torch.nn.functional.one_hot(following, len(tokenizer))
                                    .float()})

    score = evaluate_passkey(Oracle(), [(ids[:4], labels[:4], examples[:4]), (ids[4:], labels[4:], examples[4:])],
                             tokenizer)
    assert [k["key"] for k in score["keys"]] == [e.key for e in examples]
    for row, (record, example) in enumerate(zip(score["keys"], examples)):
        assert record["token_digits"] == example.answer_digits and sum(record["token_digits"]) == len(example.key)
        assert "bpe_token_digits" not in record  # scored in the tokenizer's own writing: nothing else to record
        lost = sum(example.answer_digits[t] for t in spoil.get(row, []))
        assert record["exact"] == (row not in spoil) and record["digits_right"] == len(example.key) - lost
        answer = example.input_ids[example.answer_start:]
        given = [(token + 1) % len(tokenizer) if t in spoil.get(row, []) else token for t, token in enumerate(answer)]
        assert record.get("answered") == ([tokenizer.decode([t]) for t in given] if row in spoil else None)
    assert score["exact_match"] == pytest.approx(3 / 6)
    assert score["digit_accuracy"] == pytest.approx(sum(k["digits_right"] for k in score["keys"]) / 30)

    def key(text, digits, exact):
        return {"key": text, "token_digits": digits, "digits_right": 5 if exact else 0, "exact": exact}

    cells = [{"examples": 3, "keys": [{**key("19558", [4, 1], False), "answered": [" 19", "8"]},
                                      key("48213", [2, 1, 1, 1], True),
                                      key("40057", [3, 1, 1], True)]},
             # the last key scored one digit per token: it is split by the tokenizer's own writing of it
             {"examples": 2, "keys": [key("12345", [2, 1, 1, 1], False),
                                      {**key("67890", [1, 1, 1, 1, 1], True), "bpe_token_digits": [3, 2]}]}]
    lines = misses_by_token({"gpt2_conv": {"cells": cells}, "linear_gpt2": {"cells": [{"examples": 20}]}})
    assert "| GPT-2 (softmax), short conv | 2 of 3 (67%) | 1 of 2 (50%) | 19558 (19|8), 12345 |" in lines
    assert not any("linear_gpt2 (elu+1)" in line for line in lines)  # no keys recorded: no row
    assert misses_by_token({"linear_gpt2": {"cells": [{"examples": 20}]}}) == []


@needs_wikitext
def test_presets_are_checked_and_planned(tmp_path):
    preset = load_preset(PRESETS / "passkey-cpu.json")
    assert min(preset["lengths"]) >= 512 and 1024 in preset["lengths"]
    stages = plan(preset)
    assert [s.key for s in stages][:3] == ["tokenizer", f"pretrain/{preset['models'][0]}",
                                          f"passkey/{preset['models'][0]}"]
    assert len(stages) == 1 + 2 * len(preset["models"])
    smoke = json.loads((PRESETS / "passkey-smoke.json").read_text())
    for change, message in (({"speed": 1}, "unknown keys"), ({"models": ["gpt5"]}, "unknown recall model"),
                            ({"models": ["reformer_lsh"]}, "axial position table"),
                            ({"depths": [0.5, 1.0]}, "strictly between 0 and 1"),
                            ({"train_depths": [0.9, 0.1]}, "swap them"),
                            ({"width": 40}, "not a multiple of head_size"),
                            ({"pretrain": {"max_steps": 1, "output_dir": "x"}}, "sets the model"),
                            ({"validation_file": "../shared/data/nowhere.tokens"}, "README"),
                            ({"digits": 40}, "1 to 18 digits"),
                            ({"key_tokens": "letters"}, "key_tokens must be")):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({**smoke, **change}))
        with pytest.raises(UsageError, match=message):
            load_preset(path)
    # the default writing adds nothing to a stage, so the stages recorded before the option are still the same
    assert "key_tokens" not in stages[2].args
    assert plan({**smoke, "key_tokens": "digits"})[2].args["key_tokens"] == "digits"
    random_init = plan({**smoke, "pretrain": {"max_steps": 0}})
    assert [s.kind for s in random_init] == ["tokenizer"] + ["passkey"] * len(smoke["models"])
    assert random_init[1].args["start"] == "random init"


@needs_wikitext
@pytest.mark.slow
def test_the_script_runs_the_smoke_preset_resumes_and_rerenders(tmp_path):
    command = [sys.executable, str(REPO_ROOT / "scripts" / "recall.py"), "--preset", "passkey-smoke", "--output_dir",
               str(tmp_path)]
    first = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=900, env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    preset = json.loads((PRESETS / "passkey-smoke.json").read_text())
    results = json.loads((tmp_path / "results.json").read_text())
    # a fine-tune shows its progress in the log while it runs: a line per point of the loss curve
    steps, every = preset["finetune"]["steps"], preset["finetune"]["log_every"]
    for model in preset["models"]:
        for step in range(every, steps + 1, every):
            assert f"passkey/{model}: fine-tune step {step} of {steps}, loss " in first.stdout, first.stdout[-3000:]
    assert results["meta"]["finished"] == results["meta"]["total"] == 1 + 2 * len(preset["models"])
    assert set(results["models"]) == set(preset["models"])
    for name, entry in results["models"].items():
        assert {(c["length"], c["depth"]) for c in entry["cells"]} == {
            (n, d) for n in preset["lengths"] for d in preset["depths"]}, name
        assert all(c["examples"] == preset["eval_examples"] == len(c["keys"]) for c in entry["cells"])
        # the model scored is kept, so a later question about its scores needs no second fine-tune
        assert (tmp_path / "finetune" / name / "config.json").is_file()
        assert all(entry["state_bytes"][str(n)] > 0 for n in preset["lengths"])
        assert entry["pretrain"]["perplexity"] > 1 and entry["start"] == "pretrained"
    report = (tmp_path / "results.md").read_text()
    # the grid rows, the training row and the row of misses by the key's tokens
    assert report.count("| GPT-2 (softmax) |") == 2 + len(preset["lengths"])
    assert "## Misses by the key's tokens" in report
    assert (tmp_path / "passkey.png").stat().st_size > 1000
    again = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=900, env=ENV)
    assert again.returncode == 0 and again.stdout.count("finished earlier, reused") == results["meta"]["total"]
    rerendered = subprocess.run(command + ["--report_only"], capture_output=True, text=True, cwd=REPO_ROOT, env=ENV)
    assert rerendered.returncode == 0 and (tmp_path / "results.md").read_text() == report


@pytest.mark.slow
@needs_wikitext
def test_a_models_slice_reports_every_finished_model_of_the_preset_under_the_whole_command(tmp_path):
    """A run with --models adds its models' rows to the folder's report; it does not replace them with its own
    (a slice run on 2026-11-28 had rewritten passkey-budget's report with its one model)."""
    from experiments.recall.passkey_runner import run

    preset = json.loads((PRESETS / "passkey-smoke.json").read_text())
    preset.update(models=["gpt2_sdpa", "linear_gpt2"], lengths=[64], depths=[0.5], eval_examples=2)
    preset["finetune"]["steps"] = 2
    (tmp_path / "tiny.json").write_text(json.dumps(preset))
    out = tmp_path / "out"
    argv = ["--preset", str(tmp_path / "tiny.json"), "--output_dir", str(out)]
    first = run(tmp_path / "tiny.json", out, models=["gpt2_sdpa"], argv=argv + ["--models", "gpt2_sdpa"],
                log=lambda s: None)
    assert set(first["models"]) == {"gpt2_sdpa"} and (first["meta"]["finished"], first["meta"]["total"]) == (3, 5)
    second = run(tmp_path / "tiny.json", out, models=["linear_gpt2"], argv=argv + ["--models", "linear_gpt2"],
                 log=lambda s: None)
    assert set(second["models"]) == {"gpt2_sdpa", "linear_gpt2"} and second["meta"]["finished"] == 5
    assert second["meta"]["command"] == "python scripts/recall.py " + " ".join(argv)
    report = (out / "results.md").read_text()
    assert "| GPT-2 (softmax) | 64 |" in report and "| linear_gpt2 (elu+1) | 64 |" in report
    assert "5 of 5 stages finished" in report
