"""Question answering and multiple choice in scripts/finetune.py (issue 43, item 5): SQuAD-format rows labelled
through the tokenizer's offsets (checked by decoding the labelled tokens back), SQuAD exact match / F1 against hand
computations, answers read back from crafted logits, SWAG-style rows, a tiny Linformer / linear RoBERTa trained a
few steps through the real script, and bad input refused before anything is written.

No QA or SWAG data is offline: the sets are built from WikiText-2 text by experiments/wikitext_tasks.py (cloze
questions over a paragraph; the true next sentence among four), into the test's temporary folder."""

import csv
import json
import os
import re

import evaluate
import numpy as np
import pytest
from datasets import Dataset
from helpers import TINY, TINY_DECODER, WIKITEXT, script_error
from transformers import AutoModelForMaskedLM, AutoTokenizer, BertTokenizerLegacy

from experiments.wikitext_tasks import build_choice_rows, build_qa_rows, clean, write_rows
from hf_linear_attn import LinearGPT2Config, LinearRobertaConfig, LinformerConfig
from hf_linear_attn.training.data.corpus import train_bpe_tokenizer
from hf_linear_attn.training.data.qa_tasks import answer_token_span, encode_qa_split, read_qa_files
from hf_linear_attn.training.metrics import LOCAL_METRICS
from hf_linear_attn.training.metrics.squad_scores import exact_match_score, f1_score, normalize_answer, squad_scores
from hf_linear_attn.training.qa_postprocessing import best_answers

TRAIN_TEXT, VALID_TEXT = WIKITEXT / "wiki.train.tokens", WIKITEXT / "wiki.valid.tokens"
# absent data skips the tests, except in CI, where it must be there
needs_wikitext = pytest.mark.skipif(not TRAIN_TEXT.is_file() and not os.environ.get("CI"),
                                    reason=f"WikiText-2 not found at {WIKITEXT} (see ../shared/data/README.md)")
SHORT = (40, 110)  # words of a test context: one or two windows of 128 tokens


# ------------------------------------------------------------------------------------------------------ metrics


def test_squad_scores_against_hand_computed_cases():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple, a pear and the plum.") == "apple pear and plum"
    assert exact_match_score("the Battle of Hastings.", "Battle of  hastings")
    assert not exact_match_score("Hastings", "Battle of Hastings")
    # "in 1066 AD" against "1066": 1 shared word; precision 1/3, recall 1/1 -> F1 = 2 * (1/3) / (4/3) = 0.5
    assert f1_score("in 1066 AD", "1066") == pytest.approx(0.5)
    # "red blue blue" against "blue blue green": 2 shared (blue twice); P = R = 2/3
    assert f1_score("red blue blue", "blue blue green") == pytest.approx(2 / 3)
    assert f1_score("the", "a") == 0.0  # both normalise to nothing: no shared word, F1 0 (as the official script)
    predictions = {"q1": "Hastings", "q2": "in 1066 AD", "q3": "nothing"}
    references = {"q1": ["Battle of Hastings", "Hastings"], "q2": ["1066"], "q3": ["something"], "q4": ["x"]}
    # q1 exact (the best reference), q2 F1 0.5, q3 0, q4 unanswered: 0. EM 1/4, F1 (1 + 0.5) / 4
    assert squad_scores(predictions, references) == {"exact_match": 25.0, "f1": pytest.approx(37.5)}

    # the offline evaluate module takes the Hub squad metric's inputs (a prediction for every reference; an empty
    # one for q4) and gives the same numbers
    metric = evaluate.load(str(LOCAL_METRICS / "squad"))
    result = metric.compute(
        predictions=[{"id": k, "prediction_text": v} for k, v in {**predictions, "q4": ""}.items()],
        references=[{"id": k, "answers": {"text": v, "answer_start": [0] * len(v)}} for k, v in references.items()])
    assert result == {"exact_match": 25.0, "f1": pytest.approx(37.5)}


# -------------------------------------------------------------------------------------------------- the data


@pytest.fixture(scope="module")
def qa_rows():
    if not TRAIN_TEXT.is_file():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT}")
    return (build_qa_rows(TRAIN_TEXT, 48, seed=0, split="train", context_words=SHORT),
            build_qa_rows(VALID_TEXT, 12, seed=0, split="validation", context_words=SHORT))


@pytest.fixture(scope="module")
def choice_rows():
    if not TRAIN_TEXT.is_file():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT}")
    return (build_choice_rows(TRAIN_TEXT, 48, seed=0, split="train"),
            build_choice_rows(VALID_TEXT, 16, seed=0, split="validation"))


@pytest.fixture(scope="module")
def word_tokenizer(qa_rows, choice_rows):
    texts = [row["context"] for row in qa_rows[0]] + [row["sent1"] for row in choice_rows[0]]
    return train_bpe_tokenizer(texts, vocab_size=600, style="roberta", model_max_length=128)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory, word_tokenizer):
    """Tiny untrained encoders of 128 positions, a Linformer (k = 8) and a linear RoBERTa, with the tokenizer."""
    folders = {}
    for name, config_class, extra in (("linformer", LinformerConfig, {"linformer_k": 8}),
                                      ("linear_roberta", LinearRobertaConfig, {})):
        folder = tmp_path_factory.mktemp(name)
        config = config_class(**{**TINY, **extra, "max_position_embeddings": 130, "vocab_size": len(word_tokenizer),
                                 "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2})
        AutoModelForMaskedLM.from_config(config).save_pretrained(folder)
        word_tokenizer.save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def files(tmp_path_factory, qa_rows, choice_rows):
    folder = tmp_path_factory.mktemp("sets")
    return {"qa_train": write_rows(folder / "qa_train.jsonl", qa_rows[0]),
            "qa_dev": write_rows(folder / "qa_dev.jsonl", qa_rows[1]),
            "mc_train": write_rows(folder / "mc_train.csv", choice_rows[0]),
            "mc_dev": write_rows(folder / "mc_dev.csv", choice_rows[1])}


@needs_wikitext
def test_generated_sets_hold_their_answers(qa_rows, choice_rows):
    train, _ = qa_rows
    assert len(train) == 48 and len({row["id"] for row in train}) == 48
    for row in train:
        text, start = row["answers"]["text"][0], row["answers"]["answer_start"][0]
        assert row["context"][start:start + len(text)] == text
        asked = "what number" if re.fullmatch(r"\d[\d,.]*", text) else "what"
        # the question is the answer's sentence with the answer replaced, and that sentence is in the context
        sentence = (row["question"][:-2] + " ").replace(f" {asked} ", f" {text} ", 1).strip()
        assert sentence in row["context"], (sentence, row["context"])
    assert build_qa_rows(TRAIN_TEXT, 48, seed=0, split="train", context_words=SHORT) == train  # seeded

    paragraphs = [clean(line) for line in TRAIN_TEXT.read_text(encoding="utf-8").splitlines()[:3000]]
    for row in choice_rows[0]:
        endings = [row[f"ending{i}"] for i in range(4)]
        true = f"{row['sent1']} {row['sent2']} {endings[row['label']]}"
        assert any(true in paragraph for paragraph in paragraphs)  # consecutive sentences of one paragraph
        home = next(p for p in paragraphs if true in p)
        assert all(e not in home for i, e in enumerate(endings) if i != row["label"])  # drawn from elsewhere
    assert {row["label"] for row in choice_rows[0]} == {0, 1, 2, 3}


@needs_wikitext
def test_answer_labels_decode_back_to_the_answer_text(qa_rows, word_tokenizer):
    # short windows, so that most contexts take several and many windows miss the answer (the questions of at
    # most 56 tokens leave at least 36 of the 96 for context)
    short = [row for row in qa_rows[0]
             if len(word_tokenizer(row["question"], add_special_tokens=False)["input_ids"]) <= 56]
    assert len(short) > 30
    rows = Dataset.from_list(short)
    windows = encode_qa_split(rows, word_tokenizer, max_length=96, doc_stride=16, labelled=True)
    assert len(windows) > 2 * len(rows)
    found = set()
    for window in windows:
        row = short[window["example_index"]]
        answer, start = row["answers"]["text"][0], row["answers"]["answer_start"][0]
        first, last = window["start_positions"], window["end_positions"]
        context_tokens = [i for i, o in enumerate(window["offset_mapping"]) if o is not None]
        if first == 0:  # labelled CLS: the answer's characters are not all inside this window's context
            covered = (window["offset_mapping"][context_tokens[0]][0], window["offset_mapping"][context_tokens[-1]][1])
            assert not (covered[0] <= start and start + len(answer) <= covered[1])
            assert last == 0
            continue
        # an independent check: the tokens labelled, decoded, are the answer (byte-level BPE decodes exactly)
        assert word_tokenizer.decode(window["input_ids"][first:last + 1]).strip() == answer
        assert first in context_tokens and last in context_tokens
        found.add(window["example_index"])
    assert len(found) == len(rows)  # every answer lies wholly inside at least one window

    # the labels as logits, read back by the postprocessing: every answer, exactly (EM 100)
    width = max(len(ids) for ids in windows["input_ids"])
    starts, ends = np.zeros((len(windows), width)), np.zeros((len(windows), width))
    starts[np.arange(len(windows)), windows["start_positions"]] = 10.0
    ends[np.arange(len(windows)), windows["end_positions"]] = 10.0
    answers, _ = best_answers(rows["context"], rows["id"], windows["example_index"], windows["offset_mapping"],
                              starts, ends)
    assert answers == {row["id"]: row["answers"]["text"][0] for row in short}

    # an answer that ends the context (run_qa.py's loop runs past the context there) and one inside a token
    context = "The ship was sold in 1914"
    for answer, start, expected in (("1914", 21, " 1914"), ("ship", 4, " ship")):
        encoded = word_tokenizer("When?", context, return_offsets_mapping=True)
        span = answer_token_span(encoded["offset_mapping"], encoded.sequence_ids(), start, start + len(answer))
        assert word_tokenizer.decode(encoded["input_ids"][span[0]:span[1] + 1]) == expected
    assert answer_token_span([(0, 0), (0, 3), (0, 0)], [None, 1, None], 5, 7) is None  # beyond the window


CONTEXT = "Ada wrote the first program in 1843 in London"
# a window: <s> and two question tokens (no offsets), the context's nine words at positions 3..11, </s>
WINDOW = [None, None, None, (0, 3), (4, 9), (10, 13), (14, 19), (20, 27), (28, 30), (31, 35), (36, 38), (39, 45), None]


def read_answer(logits, max_answer_length=30, windows=(WINDOW,)):
    """The answer best_answers reads from {position: (start logit, end logit)} per window (others -20; two
    positions past the window, as Trainer pads logits)."""
    starts, ends = [], []
    for given in logits:
        start, end = np.full(len(WINDOW) + 2, -20.0), np.full(len(WINDOW) + 2, -20.0)
        for position, (s, e) in given.items():
            start[position], end[position] = s, e
        starts.append(start)
        ends.append(end)
    return best_answers([CONTEXT], ["q"], [0] * len(logits), list(windows), starts, ends,
                        max_answer_length=max_answer_length)


def test_answers_are_read_from_the_best_valid_span():
    year = {9: (1.0, 1.0)}  # "1843", 2.0
    assert read_answer([year])[0] == {"q": "1843"}
    assert read_answer([{**year, 1: (9.0, -20), 2: (-20, 9.0)}])[0] == {"q": "1843"}  # the question: skipped
    assert read_answer([{**year, 8: (-20, 9.0)}])[0] == {"q": "1843"}  # ends before its start: skipped
    assert read_answer([{**year, 13: (-20, 9.0)}])[0] == {"q": "1843"}  # padding past the window: skipped
    whole = {**year, 3: (5.0, -20), 11: (-20, 5.0)}  # "Ada ... London", 10.0, nine tokens; "1843 in London" 6.0
    assert read_answer([whole], max_answer_length=2)[0] == {"q": "1843"}
    assert read_answer([whole], max_answer_length=9)[0] == {"q": CONTEXT}
    # two windows of one question: the best span of either; the n best in order, probabilities summing to 1
    answers, n_best = read_answer([{3: (2.0, 2.0)}, {9: (3.0, 2.5)}], windows=(WINDOW, WINDOW))
    assert answers == {"q": "1843"} and [c["text"] for c in n_best["q"][:2]] == ["1843", "Ada"]
    assert n_best["q"][0]["score"] == pytest.approx(5.5) and n_best["q"][1]["score"] == pytest.approx(4.0)
    assert sum(c["probability"] for c in n_best["q"]) == pytest.approx(1.0)
    # no context token at all: the empty answer
    assert read_answer([year], windows=([None] * len(WINDOW),))[0] == {"q": ""}


@needs_wikitext
def test_the_official_squad_layout_is_read_as_rows(tmp_path, qa_rows):
    row = qa_rows[0][0]
    nested = {"version": "1.1", "data": [{"title": row["title"], "paragraphs": [{"context": row["context"], "qas": [
        {"id": row["id"], "question": row["question"],
         "answers": [{"text": row["answers"]["text"][0], "answer_start": row["answers"]["answer_start"][0]}]}]}]}]}
    path = tmp_path / "dev-v1.1.json"
    path.write_text(json.dumps(nested), encoding="utf-8")
    read = read_qa_files(validation_file=str(path))["validation"]
    assert read[0] == {"id": row["id"], "title": row["title"], "context": row["context"],
                       "question": row["question"], "answers": row["answers"]}


# ---------------------------------------------------------------------------------------------- bad input


def common(model, out, task_type):
    return ["--task_type", task_type, "--model_name_or_path", str(model), "--output_dir", str(out),
            "--max_seq_length", "128", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16",
            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "True", "--disable_tqdm", "True"]


@needs_wikitext
def test_bad_qa_and_choice_input_is_refused_before_anything_is_written(tmp_path, encoders, files, qa_rows):
    from finetune import main

    out = tmp_path / "out"
    qa = [*common(encoders["linformer"], out, "question_answering"), "--do_train", "--max_steps", "2"]
    row = qa_rows[0][0]
    write = lambda name, rows: str(write_rows(tmp_path / name, rows))  # noqa: E731

    no_context = write("no_context.jsonl", [{k: v for k, v in row.items() if k != "context"}])
    message = script_error(main, [*qa, "--train_file", no_context])
    assert "has no column ['context'] for question answering" in message and "'question'" in message
    shifted = {**row, "id": "shifted",
               "answers": {"text": row["answers"]["text"], "answer_start": [row["answers"]["answer_start"][0] + 1]}}
    message = script_error(main, [*qa, "--train_file", write("shifted.jsonl", [row, shifted])])
    assert "row 2 (id 'shifted')" in message and "does not start at character" in message
    assert f"first occurs at character {row['answers']['answer_start'][0]}" in message
    unanswerable = {**row, "id": "v2", "answers": {"text": [], "answer_start": []}}
    message = script_error(main, [*qa, "--train_file", write("v2.jsonl", [row, unanswerable])])
    assert "SQuAD v2's unanswerable questions are not supported" in message
    assert "share the id" in script_error(main, [*qa, "--train_file", write("twice.jsonl", [row, row])])
    message = script_error(main, [*qa, "--train_file", str(files["qa_train"]), "--doc_stride", "128"])
    assert "--doc_stride 128 must be at least 0 and below --max_seq_length 128" in message
    long_question = {**row, "question": " ".join(["why"] * 150)}
    message = script_error(main, [*qa, "--train_file", write("long.jsonl", [long_question]), "--doc_stride", "40"])
    assert f"question {row['id']!r} is" in message and "raise --max_seq_length, lower --doc_stride" in message
    csv_file = tmp_path / "qa.csv"
    csv_file.write_text("id,question,context\n1,Who?,Ada\n")
    assert "CSV / TSV / text files cannot hold" in script_error(main, [*qa, "--train_file", str(csv_file)])

    # a slow (Python) tokenizer ignores return_offsets_mapping: refused, not trained on wrong labels
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "ship"]) + "\n")
    slow = tmp_path / "slow"
    BertTokenizerLegacy(str(vocab)).save_pretrained(slow)
    assert not AutoTokenizer.from_pretrained(slow).is_fast
    message = script_error(main, [*qa, "--train_file", str(files["qa_train"]), "--tokenizer_name_or_path", str(slow)])
    assert "is a slow (Python) tokenizer without character offsets" in message

    decoder = tmp_path / "decoder"
    LinearGPT2Config(**TINY_DECODER).save_pretrained(decoder)
    message = script_error(main, [*common(decoder, out, "question_answering"), "--train_file", str(files["qa_train"])])
    assert "a decoder (linear_gpt2) without a question-answering head" in message
    message = script_error(main, [*common(encoders["linformer"], out, "question_answering"), "--do_eval",
                                  "--validation_file", str(files["qa_dev"])])
    assert "not fine-tuned for question answering" in message  # a pretrained model's new head would be random
    sequence = [*common(encoders["linformer"], out, "sequence_classification"), "--train_file", str(files["qa_train"])]
    assert "--doc_stride apply to question answering" in script_error(main, [*sequence, "--doc_stride", "32"])
    assert "is a sequence-classification preset" in script_error(main, [*qa, "--task_name", "sst2"])

    mc = [*common(encoders["linear_roberta"], out, "multiple_choice"), "--do_train", "--max_steps", "2"]
    rows = list(csv.DictReader(open(files["mc_train"], encoding="utf-8")))
    three = tmp_path / "three.csv"
    write_rows(three, [{k: v for k, v in r.items() if k != "ending3"} | {"label": min(int(r["label"]), 2)}
                       for r in rows[:4]])
    message = script_error(main, [*mc, "--train_file", str(files["mc_train"]), "--validation_file", str(three),
                                  "--do_eval"])
    assert "has no column ['ending3'] for multiple choice" in message
    message = script_error(main, [*mc, "--train_file", write("nolabel.jsonl", [{"sent1": "A", "sent2": "B"}])])
    assert "columns ending0, ending1, ... (at least two" in message
    bad_label = tmp_path / "bad_label.csv"
    write_rows(bad_label, [rows[0], {**rows[1], "label": 4}])
    message = script_error(main, [*mc, "--train_file", str(bad_label)])
    assert "row 2 of the train data" in message and "the label 4" in message and "0 to 3" in message
    assert not out.exists()  # every refusal came before anything was written


# ---------------------------------------------------------------------------------------------- training


def run_card_example(card: str, folder, capsys) -> str:
    """What the model card's Python example prints, run on the saved folder (named in the card by its repo id)."""
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1).replace(f'"{folder.name}"', json.dumps(str(folder)))
    capsys.readouterr()
    exec(compile(code, "model card example", "exec"), {})
    return capsys.readouterr().out.strip()


@needs_wikitext
def test_question_answering_trains_and_writes_run_qa_files(tmp_path, encoders, files, qa_rows, capsys):
    from finetune import main

    tuned = tmp_path / "tuned"
    unlabelled = write_rows(tmp_path / "test.jsonl", [{k: v for k, v in row.items() if k != "answers"}
                                                      for row in qa_rows[1]])
    metrics = main([*common(encoders["linformer"], tuned, "question_answering"), "--do_train", "--do_eval",
                    "--do_predict", "--train_file", str(files["qa_train"]), "--validation_file", str(files["qa_dev"]),
                    "--test_file", str(unlabelled), "--doc_stride", "32", "--max_steps", "4",
                    "--learning_rate", "1e-3"])
    results = json.loads((tuned / "eval_results.json").read_text())
    assert {"eval_exact_match", "eval_f1", "eval_loss"} <= set(results)
    assert results["eval_samples"] == len(qa_rows[1]) and results["eval_windows"] >= len(qa_rows[1])
    assert 0 <= results["eval_exact_match"] <= results["eval_f1"] <= 100
    assert json.loads((tuned / "config.json").read_text())["architectures"] == ["LinformerForQuestionAnswering"]

    # the scores again, from eval_predictions.json and the file, by the scoring function alone
    answers = json.loads((tuned / "eval_predictions.json").read_text())
    assert set(answers) == {row["id"] for row in qa_rows[1]}
    for row in qa_rows[1]:
        assert answers[row["id"]] in row["context"]  # extracted from the context
    again = squad_scores(answers, {row["id"]: row["answers"]["text"] for row in qa_rows[1]})
    assert again["exact_match"] == pytest.approx(results["eval_exact_match"])
    assert again["f1"] == pytest.approx(results["eval_f1"])
    # test questions without answers: predictions only, the same as the validation ones (the same questions)
    assert json.loads((tuned / "predict_predictions.json").read_text()) == answers
    assert "predict_f1" not in metrics and (tuned / "predict_nbest_predictions.json").is_file()

    card = (tuned / "README.md").read_text()
    assert "pipeline_tag: question-answering" in card and "AutoModelForQuestionAnswering" in card
    assert f"| {results['eval_exact_match']:.2f} | {results['eval_f1']:.2f} |" in card  # percent already
    answer = run_card_example(card, tuned, capsys)  # (Transformers 5 has no question-answering pipeline)
    assert answer in "The European lobster lives in the eastern Atlantic Ocean and the Mediterranean Sea."

    # evaluation alone, from the fine-tuned folder: the same scores
    only = main([*common(tuned, tmp_path / "again", "question_answering"), "--do_eval", "--validation_file",
                 str(files["qa_dev"]), "--doc_stride", "32"])
    assert only["eval_f1"] == pytest.approx(results["eval_f1"])
    assert only["eval_exact_match"] == results["eval_exact_match"]
    # and with batches grouped by length (Transformers 5 groups evaluation batches too when training does): the
    # windows' logits still come back in row order, so each question gets its own answer
    grouped = main([*common(tuned, tmp_path / "grouped", "question_answering"), "--do_eval", "--validation_file",
                    str(files["qa_dev"]), "--doc_stride", "32", "--train_sampling_strategy", "group_by_length",
                    "--per_device_eval_batch_size", "4"])
    assert json.loads((tmp_path / "grouped" / "eval_predictions.json").read_text()) == answers
    assert grouped["eval_f1"] == pytest.approx(results["eval_f1"])


@needs_wikitext
def test_multiple_choice_trains_and_writes_accuracy(tmp_path, encoders, files, choice_rows, capsys):
    from finetune import main

    tuned = tmp_path / "tuned"
    metrics = main([*common(encoders["linear_roberta"], tuned, "multiple_choice"), "--do_train", "--do_eval",
                    "--do_predict", "--train_file", str(files["mc_train"]), "--validation_file", str(files["mc_dev"]),
                    "--test_file", str(files["mc_dev"]), "--max_steps", "4", "--max_seq_length", "64"])
    results = json.loads((tuned / "eval_results.json").read_text())
    assert {"eval_accuracy", "eval_loss"} <= set(results) and results["eval_samples"] == len(choice_rows[1])
    assert json.loads((tuned / "config.json").read_text())["architectures"] == ["LinearRobertaForMultipleChoice"]
    lines = (tuned / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == len(choice_rows[1]) + 1
    chosen = [int(line.split("\t")[1]) for line in lines[1:]]
    right = sum(c == row["label"] for c, row in zip(chosen, choice_rows[1])) / len(chosen)
    assert metrics["predict_accuracy"] == pytest.approx(right) == pytest.approx(results["eval_accuracy"])
    card = (tuned / "README.md").read_text()
    assert "AutoModelForMultipleChoice" in card and "pipeline_tag" not in card and "multiple-choice" in card
    assert run_card_example(card, tuned, capsys) in ("It turned red.", "It sang a song.", "It won the election.",
                                                     "It rained.")
