"""scripts/finetune.py at run_glue.py's conventions (issue 27): --do_train / --do_eval / --do_predict honoured,
train / validation / test files with any text and label columns (classification or regression), predictions and
the results files of Transformers' examples; --push_to_hub checked before any training.

A tiny encoder saved in the test (no pretraining run) keeps these fast."""

import json

import pytest
from helpers import NEGATIVE, POSITIVE, script_error, write_rows

def common(model, out):
    return ["--model_name_or_path", str(model), "--output_dir", str(out), "--max_seq_length", "32",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_steps", "3",
            "--save_strategy", "no", "--report_to", "none", "--logging_steps", "1", "--use_cpu", "True"]



def test_do_train_eval_predict_are_honoured_and_write_the_example_scripts_files(tmp_path, base_model, review_files):
    from finetune import main

    train, dev, test = review_files
    columns = ["--text_columns", "review", "--label_column", "verdict"]
    tuned = tmp_path / "tuned"
    metrics = main([*common(base_model, tuned), "--do_train", "--do_eval", "--do_predict", *columns,
                    "--train_file", str(train), "--validation_file", str(dev), "--test_file", str(test)])
    for name in ("train_results.json", "eval_results.json", "predict_results.json", "all_results.json",
                 "trainer_state.json", "predict_results.txt", "model.safetensors", "README.md"):
        assert (tuned / name).is_file(), name
    state = json.loads((tuned / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]
    everything = json.loads((tuned / "all_results.json").read_text())
    assert {"train_loss", "eval_accuracy", "eval_samples", "predict_samples"} <= set(everything)
    assert everything["eval_samples"] == 3 and metrics["eval_accuracy"] == everything["eval_accuracy"]
    config = json.loads((tuned / "config.json").read_text())
    assert config["id2label"] == {"0": "bad", "1": "good"}  # the label column's values, sorted
    lines = (tuned / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 3
    assert all(line.split("\t")[1] in ("bad", "good") for line in lines[1:])

    # --do_eval alone evaluates the checkpoint: no training, nothing of the model written or changed
    weights_before = (tuned / "model.safetensors").read_bytes()
    evaluated = tmp_path / "evaluated"
    metrics = main([*common(tuned, evaluated), "--do_eval", *columns, "--validation_file", str(dev)])
    assert not (evaluated / "model.safetensors").exists() and not (evaluated / "train_results.json").exists()
    assert (tuned / "model.safetensors").read_bytes() == weights_before
    again = json.loads((evaluated / "eval_results.json").read_text())
    assert again["eval_accuracy"] == everything["eval_accuracy"] and "train_loss" not in metrics
    assert again["eval_loss"] == pytest.approx(everything["eval_loss"], rel=1e-5)

    # --do_predict alone: the checkpoint's own labels, the same predictions
    predicted = tmp_path / "predicted"
    main([*common(tuned, predicted), "--do_predict", *columns, "--test_file", str(test)])
    assert (predicted / "predict_results.txt").read_text().splitlines() == lines
    assert not (predicted / "model.safetensors").exists()


def test_regression_and_sentence_pairs_from_json_lines(tmp_path, base_model):
    from finetune import main

    rows = [{"premise": POSITIVE[i % 6], "hypothesis": NEGATIVE[i % 6], "score": 0.5 * i} for i in range(8)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    main([*common(base_model, out), "--do_train", "--do_eval", "--text_columns", "premise,hypothesis",
          "--label_column", "score", "--train_file", str(data), "--validation_file", str(data)])
    results = json.loads((out / "eval_results.json").read_text())
    assert {"eval_mse", "eval_pearson"} <= set(results)
    config = json.loads((out / "config.json").read_text())
    assert len(config["id2label"]) == 1
    assert config["problem_type"] == "regression"


def test_new_finetuning_flags_refuse_bad_values(tmp_path, base_model, review_files):
    from finetune import main

    train, dev, test = review_files
    base = common(base_model, tmp_path / "out")
    columns = ["--text_columns", "review", "--label_column", "verdict"]
    assert "--text_columns must name one text column or two" in script_error(
        main, [*base, "--do_train", "--text_columns", "a,b,c", "--train_file", str(train)])
    assert "no task: pass --task_name" in script_error(main, [*base, "--do_train", "--train_file", str(train)])
    message = script_error(main, [*base, "--do_train", "--task_name", "sst2", *columns, "--train_file", str(train)])
    assert "--text_columns / --label_column are for data without a preset" in message
    message = script_error(main, [*base, "--do_eval", *columns, "--test_file", str(test)])
    assert "--do_eval needs validation data: pass --validation_file" in message
    message = script_error(main, [*base, "--do_predict", *columns, "--validation_file", str(dev)])
    assert "--do_predict needs test data: pass --test_file" in message
    message = script_error(main, [*base, "--do_train", "--text_columns", "review", "--train_file", str(train)])
    assert "no label column 'label'" in message and "'verdict'" in message
    message = script_error(main, [*base, "--do_train", "--text_columns", "text", "--label_column", "verdict",
                            "--train_file", str(train)])
    assert "needs the columns ['text']" in message
    assert "--max_predict_samples must be at least 1" in script_error(
        main, [*base, "--do_predict", *columns, "--test_file", str(test), "--max_predict_samples", "0"])
    # labels of the validation file that training never saw
    odd = write_rows(tmp_path / "odd.csv", [("review", "verdict"), ("fine", "neutral")])
    message = script_error(main, [*base, "--do_train", "--do_eval", *columns, "--train_file", str(train),
                            "--validation_file", str(odd)])
    assert "labels ['neutral']" in message and "['bad', 'good']" in message
    # a preset's columns are checked in evaluation-only runs too
    message = script_error(main, [*base, "--do_eval", "--task_name", "sst2", "--validation_file", str(dev)])
    assert "needs the columns ['sentence']" in message
    assert not (tmp_path / "out").exists()  # every refusal came before anything was written


def test_eval_length_split_scores_the_long_rows_apart(tmp_path, base_model, tokenizer, review_files):
    """--eval_length_split N: the evaluation rows longer than N tokens before truncation scored apart from the rest.
    Independent reference: the same checkpoint's predictions of the same rows (--do_predict on that file, written in
    file order), read back and counted by lengths from the tokenizer."""
    from finetune import main

    train = review_files[0]
    texts = [*POSITIVE, *NEGATIVE]
    rows = [(" and ".join(texts[i: i + 1 + i % 4]), "good" if i < 6 else "bad") for i in range(len(texts))]
    dev = write_rows(tmp_path / "dev.tsv", [("review", "verdict"), *rows], "\t")
    lengths = [len(tokenizer(text)["input_ids"]) for text, _ in rows]
    split = sorted(lengths)[len(lengths) // 2]
    assert 0 < sum(n > split for n in lengths) < len(lengths) and max(lengths) > 32  # both parts, some rows cut
    columns = ["--text_columns", "review", "--label_column", "verdict"]
    tuned = tmp_path / "tuned"
    main([*common(base_model, tuned), "--do_train", *columns, "--train_file", str(train)])
    out = tmp_path / "out"
    # grouped by length, as the IMDB presets run: the parts must still be read in file order (a tiny model may guess
    # one label for every row; the labels, which travel with the guesses, then differ between the parts)
    main([*common(tuned, out), "--do_eval", "--do_predict", *columns, "--validation_file", str(dev),
          "--test_file", str(dev), "--eval_length_split", str(split), "--train_sampling_strategy", "group_by_length"])
    results = json.loads((out / "all_results.json").read_text())
    predicted = [line.split("\t")[1] for line in (out / "predict_results.txt").read_text().splitlines()[1:]]
    right = [guess == label for guess, (_, label) in zip(predicted, rows)]
    beyond = [n > split for n in lengths]
    for part, keep in (("within", [not b for b in beyond]), ("beyond", beyond)):
        hits = [r for r, k in zip(right, keep) if k]
        assert results[f"eval_rows_{part}_{split}"] == len(hits)
        assert results[f"eval_accuracy_{part}_{split}"] == pytest.approx(sum(hits) / len(hits))
    assert results["eval_accuracy"] == pytest.approx(sum(right) / len(right))
    assert not any("_beyond_" in key for key in results if key.startswith("predict_"))  # the test split: whole
    message = script_error(main, [*common(tuned, tmp_path / "x"), "--do_predict", *columns, "--test_file", str(dev),
                                  "--eval_length_split", "64"])
    assert "--eval_length_split splits the evaluation's score: add --do_eval" in message
    message = script_error(main, [*common(tuned, tmp_path / "x"), "--do_eval", *columns, "--validation_file",
                                  str(dev), "--eval_length_split", "0"])
    assert "--eval_length_split must be at least 1" in message
    assert not (tmp_path / "x").exists()


def test_config_overrides_reach_the_trained_model_and_bad_ones_are_refused(tmp_path, base_model, review_files):
    """--config_overrides (run_mlm.py's flag) changes the checkpoint's config for the run: the fine-tuned model's
    dropout modules and its saved config carry the new values; a misspelt key, a malformed list or a value of the
    wrong type is refused before anything is written."""
    import torch
    from finetune import main
    from transformers import AutoModelForSequenceClassification

    train = review_files[0]
    columns = ["--text_columns", "review", "--label_column", "verdict", "--train_file", str(train)]
    tuned = tmp_path / "tuned"
    main([*common(base_model, tuned), "--do_train", *columns,
          "--config_overrides", "attention_probs_dropout_prob=0,hidden_dropout_prob=0.25"])
    config = json.loads((tuned / "config.json").read_text())
    assert (config["attention_probs_dropout_prob"], config["hidden_dropout_prob"]) == (0.0, 0.25)
    model = AutoModelForSequenceClassification.from_pretrained(tuned)
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert 0.25 in rates and 0.1 not in rates  # the checkpoint's 0.1 replaced wherever it was used
    out = tmp_path / "out"
    for overrides, expected in (
        ("attention_dropout_prob=0", "names attention_dropout_prob, not in"),
        ("attention_probs_dropout_prob", "comma-separated key=value pairs"),
        ("hidden_dropout_prob=0,hidden_dropout_prob=0.1", "each key once"),
        ("hidden_dropout_prob=lots", "--config_overrides:"),
    ):
        said = script_error(main, [*common(base_model, out), "--do_train", *columns, "--config_overrides", overrides])
        assert expected in said, (overrides, said)
        assert not out.exists(), overrides


# ------------------------------------------------------------------------------------------ push before training


class HubStandIn:
    """huggingface_hub.HfApi as far as the pre-training check uses it; `answer` is whoami's reply or an error."""

    answer = {"name": "someone", "auth": {"accessToken": {"role": "write"}}}
    calls = []

    def __init__(self, token=None):
        self.token = token

    def whoami(self):
        self.calls.append(("whoami", self.token))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_push_to_hub_is_checked_before_any_training(tmp_path, base_model, review_files, monkeypatch):
    from finetune import main

    from hf_linear_attn.training import hub

    train, dev, _ = review_files
    monkeypatch.setattr(hub, "HfApi", HubStandIn)
    monkeypatch.setattr(hub, "get_token", lambda: None)
    out = tmp_path / "out"
    run = [*common(base_model, out), "--text_columns", "review", "--label_column", "verdict", "--train_file",
           str(train), "--validation_file", str(dev), "--push_to_hub"]
    assert "--push_to_hub needs a Hub token" in script_error(main, run)
    assert "not a valid Hub repo name" in script_error(main, [*run, "--hub_token", "hf_x", "--hub_model_id", "a/b/c"])
    HubStandIn.answer = OSError("Cannot reach https://huggingface.co: offline mode is enabled")
    message = script_error(main, [*run, "--hub_token", "hf_x"])
    assert "the Hub does not accept this token or cannot be reached" in message and "offline mode" in message
    HubStandIn.answer = {"name": "someone", "auth": {"accessToken": {"role": "read"}}}
    assert "the token is read-only" in script_error(main, [*run, "--hub_token", "hf_x"])
    assert "--push_to_hub uploads a fine-tuned model: add --do_train" in script_error(
        main, [*run, "--hub_token", "hf_x", "--do_eval"])
    assert not out.exists()  # refused at once: nothing trained, nothing written
    HubStandIn.answer = {"name": "someone", "auth": {"accessToken": {"role": "write"}}}
    assert hub.check_push_target("tuned", "hf_x") == "someone/tuned"
    assert hub.check_push_target("org/tuned", "hf_x") == "org/tuned"


def test_cards_name_a_hub_base_model_and_leave_local_folders_out(tmp_path):
    from hf_linear_attn.training.model_cards import hub_base_model

    assert hub_base_model("FacebookAI/roberta-base") == "FacebookAI/roberta-base"
    assert hub_base_model(str(tmp_path)) is None  # a local folder is no Hub id
    (tmp_path / "README.md").write_text("---\nbase_model: FacebookAI/roberta-base\n---\n# converted\n")
    assert hub_base_model(str(tmp_path)) == "FacebookAI/roberta-base"  # the folder's own card names its base


# ------------------------------------------------------------------------------------ knowledge distillation


def test_distillation_loss_is_the_weighted_cross_entropy_and_tempered_kl_of_a_float64_reference():
    import torch

    from hf_linear_attn.training.task_distillation import distillation_loss

    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 3, generator=generator), torch.randn(5, 3, generator=generator)
    labels = torch.tensor([0, 2, 1, 1, 0])
    s, t = student.double(), teacher.double()
    for alpha, temperature in ((0.0, 2.0), (1.0, 1.0), (0.3, 2.5)):
        p_t, log_p_s = torch.softmax(t / temperature, -1), torch.log_softmax(s / temperature, -1)
        kl = (p_t * (torch.log(p_t) - log_p_s)).sum(-1).mean()
        hard = -torch.log_softmax(s, -1)[torch.arange(5), labels].mean()
        expected = (1 - alpha) * hard + alpha * temperature**2 * kl
        assert float(distillation_loss(student, teacher, labels, alpha, temperature)) == pytest.approx(
            float(expected), rel=1e-5)


def test_fine_tuning_against_a_teacher_learns_its_probabilities_and_evaluates_with_the_plain_loss(
        tmp_path, base_model, review_files):
    """--distill_from: a student that is its teacher (no dropout) has a distillation loss of 0 at alpha = 1, and its
    evaluation loss is the teacher's own cross-entropy (evaluation ignores the teacher), not 0; with
    alpha = 0 the run is the plain fine-tune's, step for step. Settings that cannot work are refused first."""
    from finetune import main

    train, dev, _ = review_files
    columns = ["--text_columns", "review", "--label_column", "verdict", "--train_file", str(train),
               "--validation_file", str(dev), "--do_train", "--do_eval"]
    teacher = tmp_path / "teacher"
    taught = main([*common(base_model, teacher), *columns])

    def losses(folder):
        state = json.loads((folder / "trainer_state.json").read_text())
        return [entry["loss"] for entry in state["log_history"] if "loss" in entry]

    itself = main([*common(teacher, tmp_path / "itself"), *columns, "--distill_from", str(teacher),
                   "--distill_alpha", "1"])
    assert all(loss < 1e-6 for loss in losses(tmp_path / "itself"))  # float32 rounding apart, KL = 0
    assert itself["eval_loss"] == pytest.approx(taught["eval_loss"], rel=1e-3)  # the teacher's own cross-entropy
    plain = main([*common(base_model, tmp_path / "plain"), *columns])
    hard = main([*common(base_model, tmp_path / "hard"), *columns, "--distill_from", str(teacher),
                 "--distill_alpha", "0"])
    assert losses(tmp_path / "hard") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)
    assert hard["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    soft = main([*common(base_model, tmp_path / "soft"), *columns, "--distill_from", str(teacher)])
    assert losses(tmp_path / "soft") != losses(tmp_path / "plain") and soft["eval_samples"] == 3

    refused = common(base_model, tmp_path / "refused")
    assert "nothing is trained" in script_error(main, [*refused, *columns[:-2], "--do_eval", "--distill_from",
                                                       str(teacher)])
    assert "between 0 (labels only) and 1" in script_error(main, [*refused, *columns, "--distill_from", str(teacher),
                                                                  "--distill_alpha", "1.5"])
    assert "must be positive" in script_error(main, [*refused, *columns, "--distill_from", str(teacher),
                                                     "--distill_temperature", "0"])
    other = write_rows(tmp_path / "other.csv", [("review", "verdict")] + [(t, "pos") for t in POSITIVE]
                       + [(t, "neg") for t in NEGATIVE])
    message = script_error(main, [*refused, "--text_columns", "review", "--label_column", "verdict", "--train_file",
                                  str(other), "--do_train", "--distill_from", str(teacher)])
    assert "scores the labels {'bad': 0, 'good': 1}" in message and "fine-tuned on this task" in message
    assert not (tmp_path / "refused").exists()


def test_do_eval_alone_on_a_train_file_scores_the_rows_its_fine_tune_held_out(tmp_path, base_model, review_files):
    """Without a validation file the evaluation rows are carved from the train file by the seed (IMDB's case). A
    later --do_eval of the fine-tuned model with the same train file and seed scores those same rows: the same
    count, accuracy and loss as the fine-tune's own evaluation."""
    from finetune import main

    train, _, _ = review_files
    columns = ["--text_columns", "review", "--label_column", "verdict", "--validation_split_percentage", "50"]
    tuned = tmp_path / "tuned"
    main([*common(base_model, tuned), "--do_train", "--do_eval", *columns, "--train_file", str(train)])
    during = json.loads((tuned / "eval_results.json").read_text())
    evaluated = tmp_path / "evaluated"
    main([*common(tuned, evaluated), "--do_eval", *columns, "--train_file", str(train)])
    after = json.loads((evaluated / "eval_results.json").read_text())
    assert not (evaluated / "model.safetensors").exists() and not (evaluated / "train_results.json").exists()
    assert after["eval_samples"] == during["eval_samples"] and after["eval_accuracy"] == during["eval_accuracy"]
    assert after["eval_loss"] == pytest.approx(during["eval_loss"], rel=1e-5)
    # another seed holds out other rows
    other = tmp_path / "other-seed"
    main([*common(tuned, other), "--do_eval", *columns, "--train_file", str(train), "--seed", "7"])
    assert json.loads((other / "eval_results.json").read_text())["eval_loss"] != pytest.approx(during["eval_loss"])
