"""Token classification in scripts/finetune.py (issue 27): CoNLL-style rows (a list of words, a list of labels),
labels aligned to sub-tokens as run_ner.py aligns them, entity precision / recall / F1, predict_results.txt with
one line of labels per row, and bad data refused before training.

No token-labelled corpus is available offline, so the tests label real text by a rule: WikiText-2 sentences, split
into words, where a run of capitalised words is a CAP entity (B-CAP, I-CAP) and a number a NUM entity (B-NUM); a
tiny encoder, saved untrained in the test, learns that in a few seconds."""

import json
import random
import re
from collections import Counter

import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value
from helpers import TINY, TINY_DECODER, WIKITEXT, data_missing, script_error
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerFast

from hf_linear_attn import LinearGPT2Config, LinformerConfig
from hf_linear_attn.training.data.corpus import train_bpe_tokenizer
from hf_linear_attn.training.data.token_tasks import (
    TokenTask, align_word_labels, continuation_label_ids, encode_token_task, load_token_data,
    prepare_tokenizer_for_words, token_label_names,
)
from hf_linear_attn.training.errors import UsageError
from hf_linear_attn.training.metrics.entities import entity_scores, entity_spans

needs_wikitext = pytest.mark.skipif(data_missing(WIKITEXT / "wiki.train.tokens"),
                                    reason=f"WikiText-2 not found at {WIKITEXT} (see ../shared/data/README.md)")
LABELS = ("B-CAP", "B-NUM", "I-CAP", "O")  # the rule's labels, sorted as the script sorts text labels


def rule_tags(words):
    """The rule the model learns: capitalised runs are CAP entities, numbers NUM entities, the rest O."""
    tags = []
    for word in words:
        if re.fullmatch(r"\d[\d,.]*", word):
            tags.append("B-NUM")
        elif word[0].isupper():
            tags.append("I-CAP" if tags and tags[-1] in ("B-CAP", "I-CAP") else "B-CAP")
        else:
            tags.append("O")
    return tags


def wikitext_sentences(count, min_words=4, max_words=16):
    """The first `count` sentences of WikiText-2 train (headings skipped, paragraphs cut at " . ") as word lists."""
    sentences = []
    with open(WIKITEXT / "wiki.train.tokens", encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("="):
                continue
            for sentence in line.split(" . "):
                words = sentence.split()
                if min_words <= len(words) <= max_words:
                    sentences.append(words)
                    if len(sentences) == count:
                        return sentences
    return sentences


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sentences():
    if not (WIKITEXT / "wiki.train.tokens").is_file():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT}")
    return wikitext_sentences(1500)


@pytest.fixture(scope="module")
def word_tokenizer(sentences):
    """A byte-level BPE (RoBERTa's special tokens) trained on the sentences, loaded back from its folder as a user's
    would be: the generic tokenizer class of tokenizer.json files, without add_prefix_space."""
    return train_bpe_tokenizer([" ".join(s) for s in sentences], vocab_size=800, style="roberta",
                               model_max_length=64)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory, word_tokenizer):
    """A tiny untrained Linformer encoder with the tokenizer beside it."""
    folder = tmp_path_factory.mktemp("encoder")
    config = LinformerConfig(**{**TINY, "vocab_size": len(word_tokenizer), "linformer_k": 8, "pad_token_id": 1,
                                "bos_token_id": 0, "eos_token_id": 2})
    AutoModelForMaskedLM.from_config(config).save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def conll_files(tmp_path_factory, sentences):
    """train / dev / test JSON lines of WikiText sentences with the rule's labels; the test file's last row is
    three sentences long, longer than 64 tokens."""
    folder = tmp_path_factory.mktemp("conll")
    rows = [{"tokens": words, "ner_tags": rule_tags(words)} for words in sentences]
    long_words = sentences[-1] + sentences[-2] + sentences[-3]
    test = rows[1400:1440] + [{"tokens": long_words, "ner_tags": rule_tags(long_words)}]
    return (write_jsonl(folder / "train.jsonl", rows[:1200]), write_jsonl(folder / "dev.jsonl", rows[1200:1400]),
            write_jsonl(folder / "test.jsonl", test))


def common(model, out):
    return ["--task_type", "token_classification", "--model_name_or_path", str(model), "--output_dir", str(out),
            "--max_seq_length", "64", "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32",
            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "True", "--disable_tqdm", "True"]



# ------------------------------------------------------------------------------------------------------ metrics


def test_entity_scores_against_a_hand_count():
    references = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG", "I-ORG", "I-ORG"]]
    predictions = [["B-PER", "I-PER", "O", "B-PER"], ["O", "B-ORG", "I-ORG", "O"]]
    # reference entities: PER 0-2, LOC 3, ORG 1-4 (three); predicted: PER 0-2 (right), PER 3 (wrong type),
    # ORG 1-3 (wrong span): 1 right of 3 predicted, of 3 to find
    scores = entity_scores(predictions, references)
    assert scores["overall_precision"] == pytest.approx(1 / 3) and scores["overall_recall"] == pytest.approx(1 / 3)
    assert scores["overall_f1"] == pytest.approx(1 / 3)
    assert scores["overall_accuracy"] == pytest.approx(6 / 8)  # words 3 (B-LOC) and 7 (I-ORG) are wrong
    assert scores["PER"] == {"precision": 0.5, "recall": 1.0, "f1": pytest.approx(2 / 3), "number": 1}
    assert scores["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "number": 1}
    assert scores["ORG"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "number": 1}
    # conlleval's reading of tags: I- after O or after another type begins an entity; E / S close one; a tag
    # without a prefix is a one-word entity
    assert entity_spans(["O", "I-X", "I-X", "I-Y", "B-Y", "O"]) == [("X", 1, 3), ("Y", 3, 4), ("Y", 4, 5)]
    assert entity_spans(["B-X", "E-X", "I-X", "S-X", "NOUN", "NOUN"]) == [
        ("X", 0, 2), ("X", 2, 3), ("X", 3, 4), ("NOUN", 4, 5), ("NOUN", 5, 6)]
    # entities never run across sentences
    assert entity_scores([["B-X"], ["I-X"]], [["B-X"], ["I-X"]])["X"]["number"] == 2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # sklearn averages over types with no entity
def test_entity_scores_agree_with_seqeval():
    """seqeval (pip install "hf-linear-attn[ner]"), the reference implementation of conlleval's scores in Python,
    on random tag sequences of every prefix."""
    metrics = pytest.importorskip("seqeval.metrics", reason="seqeval is not installed (the [ner] extra)")
    rng = random.Random(0)
    tags = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"]
    for _ in range(300):
        references = [[rng.choice(tags) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 4))]
        predictions = [[rng.choice(tags) for _ in row] for row in references]
        ours = entity_scores(predictions, references)
        report = metrics.classification_report(references, predictions, output_dict=True, zero_division=0)
        micro = report.pop("micro avg")
        report.pop("macro avg"), report.pop("weighted avg")
        assert ours["overall_precision"] == pytest.approx(micro["precision"])
        assert ours["overall_recall"] == pytest.approx(micro["recall"])
        assert ours["overall_f1"] == pytest.approx(micro["f1-score"])
        assert ours["overall_accuracy"] == pytest.approx(metrics.accuracy_score(references, predictions))
        assert {k for k, v in ours.items() if isinstance(v, dict)} == set(report)
        for kind, theirs in report.items():
            assert ours[kind]["number"] == theirs["support"]
            assert (ours[kind]["precision"], ours[kind]["recall"], ours[kind]["f1"]) == pytest.approx(
                (theirs["precision"], theirs["recall"], theirs["f1-score"]))


# ------------------------------------------------------------------------------------------ data and alignment


def _saved_copy(tokenizer, folder):
    """The folder, with the tokenizer saved in it (loaded back as users load tokenizers)."""
    tokenizer.save_pretrained(folder)
    return folder


@needs_wikitext
def test_labels_sit_on_each_words_first_sub_token(tmp_path, sentences, word_tokenizer):
    tokenizer = prepare_tokenizer_for_words(AutoTokenizer.from_pretrained(_saved_copy(word_tokenizer, tmp_path)),
                                            "test")
    # (WikiText's literal "<unk>" is the tokenizer's special token, one token with no space before it)
    rows = [words for words in sentences if "<unk>" not in words][:2]
    tags = [rule_tags(words) for words in rows]
    task = TokenTask("t", "tokens", "ner_tags", LABELS)
    ids = [[LABELS.index(t) for t in row] for row in tags]
    data = DatasetDict(train=Dataset.from_dict({"tokens": rows, "labels": ids}),
                       validation=Dataset.from_dict({"tokens": rows, "labels": ids}))
    plain = encode_token_task(data, task, tokenizer, max_length=64)
    spread = encode_token_task(data, task, tokenizer, max_length=64, label_all_tokens=True)
    for row, (words, labels) in enumerate(zip(rows, ids)):
        # by hand: each word on its own, after a space, as in running text
        pieces = [len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) for word in words]
        assert any(n > 1 for n in pieces)  # the rows have words of several sub-tokens
        first_only, every, starts = [-100], [-100], []
        for word_label, n in zip(labels, pieces):
            starts.append(len(first_only))
            first_only += [word_label] + [-100] * (n - 1)
            inside = LABELS.index("I-CAP") if LABELS[word_label] == "B-CAP" else word_label  # B-X -> I-X
            every += [word_label] + [inside] * (n - 1)
        first_only.append(-100)
        every.append(-100)
        assert plain["train"][row]["labels"] == first_only
        assert plain["train"][row]["word_starts"] == starts
        assert len(plain["train"][row]["input_ids"]) == sum(pieces) + 2  # <s> ... </s>
        assert spread["train"][row]["labels"] == every
        assert spread["validation"][row]["labels"] == first_only  # evaluation stays one label per word
    assert continuation_label_ids(["O", "B-X", "I-X", "B-Y"]) == [0, 2, 2, 3]  # B-Y has no I-Y: kept
    assert align_word_labels([None, 0, 0, 1, None], [5, 6]) == [-100, 5, -100, 6, -100]


def test_pre_split_words_get_the_tokens_of_running_text(tmp_path, tokenizer):
    """This package's tokenizer.json files load as the generic tokenizer class, which accepts add_prefix_space=True
    and ignores it: the byte-level pre-tokenizer is set instead, and a tokenizer that cannot be fixed is refused."""
    words = ["Linear", "attention", "replaces", "the", "softmax"]
    folder = _saved_copy(tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(folder, add_prefix_space=True)
    assert loaded(words, is_split_into_words=True, add_special_tokens=False)["input_ids"] != \
        loaded(" " + " ".join(words), add_special_tokens=False)["input_ids"]  # the argument alone did nothing
    ready = prepare_tokenizer_for_words(loaded, "test")
    assert ready(words, is_split_into_words=True, add_special_tokens=False)["input_ids"] == \
        ready(" " + " ".join(words), add_special_tokens=False)["input_ids"]
    assert ready.convert_ids_to_tokens(ready(["Linear"], is_split_into_words=True)["input_ids"])[1].startswith("Ġ")

    # a word-level tokenizer that keeps spaces as tokens: running text has them, pre-split words not
    words_and_spaces = Tokenizer(WordLevel({"[UNK]": 0, " ": 1, "The": 2, "dog": 3}, unk_token="[UNK]"))
    words_and_spaces.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    broken = PreTrainedTokenizerFast(tokenizer_object=words_and_spaces, unk_token="[UNK]")
    with pytest.raises(UsageError, match="tokenizes pre-split words differently from running text"):
        prepare_tokenizer_for_words(broken, "test")


def test_label_names_from_a_class_label_a_given_list_or_the_sorted_labels():
    hub_like = Features({"tokens": List(Value("string")),
                         "ner_tags": List(ClassLabel(names=["O", "B-PER", "I-PER"]))})
    rows = {"tokens": [["Ada", "Lovelace", "wrote"], ["It", "ran"]], "ner_tags": [[1, 2, 0], [0, 0]]}
    raw = DatasetDict(train=Dataset.from_dict(rows, features=hub_like),
                      validation=Dataset.from_dict(rows, features=hub_like))
    assert token_label_names(raw["train"], "ner_tags") == (("O", "B-PER", "I-PER"), True)
    assert token_label_names(raw["train"], "ner_tags", ("A", "B", "C")) == (("A", "B", "C"), True)
    text = Dataset.from_dict({"ner_tags": [["O", "B-PER"], ["I-PER"]]})
    assert token_label_names(text, "ner_tags") == (("B-PER", "I-PER", "O"), False)
    numbers = Dataset.from_dict({"ner_tags": [[10, 2], [2]]})
    assert token_label_names(numbers, "ner_tags") == (("2", "10"), False)

    # a Hub dataset's splits take the same path as local files after loading
    task = TokenTask("people", "tokens", "ner_tags", ("O", "B-PER", "I-PER"), "someone/people")
    data, eval_split = load_token_data(task, raw, dataset_name="someone/people")
    assert eval_split == "someone/people validation"
    assert data["train"]["labels"] == [[1, 2, 0], [0, 0]] and data["validation"]["tokens"] == rows["tokens"]


# ---------------------------------------------------------------------------------------------- bad input


@needs_wikitext
def test_bad_token_data_is_refused_before_training(tmp_path, encoder, conll_files):
    from finetune import main

    train, dev, _ = conll_files
    out = tmp_path / "out"
    base = [*common(encoder, out), "--max_steps", "2"]
    rows = [{"tokens": ["The", "ship", "sailed"], "ner_tags": ["B-CAP", "O", "O"]},
            {"tokens": ["It", "sank", "in", "1914"], "ner_tags": ["B-CAP", "O", "O", "B-NUM"]},
            {"tokens": ["Zrínyi", "was", "sold"], "ner_tags": ["B-CAP", "O"]}]  # a label short
    short = write_jsonl(tmp_path / "short.jsonl", rows)
    message = script_error(main, [*base, "--do_train", "--train_file", str(short)])
    assert "row 3 of the train data" in message and "3 words in 'tokens' but 2 labels in 'ner_tags'" in message

    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"tokens": ["Ada"], "ner_tags": ["B-PER"]}])
    message = script_error(main, [*base, "--do_train", "--do_eval", "--train_file", str(train), "--validation_file",
                            str(unknown)])
    assert "labels ['B-PER'] that are not among the label names" in message and "first in row 1" in message
    message = script_error(main, [*base, "--do_train", "--train_file", str(train), "--label_list", "O,B-CAP,I-CAP"])
    assert "labels ['B-NUM']" in message  # a label that --label_list leaves out

    empty = write_jsonl(tmp_path / "empty.jsonl", [rows[0], {"tokens": ["The", "", "ship"], "ner_tags": ["O"] * 3}])
    assert "row 2 of the train data" in script_error(main, [*base, "--do_train", "--train_file", str(empty)])

    message = script_error(main, [*base, "--do_train", "--train_file", str(train), "--label_column", "tags"])
    assert "no column 'tags' (--label_column)" in message and "['tokens', 'ner_tags']" in message
    message = script_error(main, [*base, "--do_train", "--train_file", str(train), "--text_columns", "words"])
    assert "no column 'words' (--text_columns)" in message
    message = script_error(main, [*base, "--do_eval", "--validation_file", str(dev)])
    assert "not fine-tuned for token classification" in message  # a pretrained model's head would be random

    outside = write_jsonl(tmp_path / "outside.jsonl", [{"tokens": r["tokens"], "ner_tags": ["O"] * len(r["tokens"])}
                                                       for r in rows[:2]])
    assert "has the same label" in script_error(main, [*base, "--do_train", "--train_file", str(outside)])
    message = script_error(main, [*base, "--do_train", "--train_file", str(train), "--max_seq_length", "2"])
    assert "--max_seq_length 2 leaves no room for words (2 special tokens)" in message

    csv_file = tmp_path / "train.csv"
    csv_file.write_text("tokens,ner_tags\nThe,O\n")
    assert "CSV / TSV / text files cannot hold" in script_error(main, [*base, "--do_train", "--train_file", str(csv_file)])

    decoder = tmp_path / "decoder"
    LinearGPT2Config(**TINY_DECODER).save_pretrained(decoder)
    message = script_error(main, [*common(decoder, out), "--do_train", "--train_file", str(train)])
    assert "a decoder (linear_gpt2) without a token-classification head" in message
    assert "linear_roberta, linformer" in message

    message = script_error(main, [*base, "--do_train", "--task_name", "sst2", "--train_file", str(train)])
    assert "is a sequence-classification preset" in message
    sequence = [arg for arg in base if arg not in ("--task_type", "token_classification")]
    message = script_error(main, [*sequence, "--do_train", "--train_file", str(train), "--label_all_tokens", "True"])
    assert "--label_all_tokens apply to token classification" in message
    assert not out.exists()  # every refusal came before anything was written


# ---------------------------------------------------------------------------------------------- training


def spans_bio(tags):
    """BIO entities read independently of the package: an entity begins at B-, or at I- after O or another type,
    and takes the I- tags of its type that follow."""
    found = []
    for start, tag in enumerate(tags):
        kind = tag[2:]
        if tag != "O" and (tag.startswith("B-") or start == 0 or tags[start - 1][2:] != kind):
            end = start + 1
            while end < len(tags) and tags[end] == "I-" + kind:
                end += 1
            found.append((kind, start, end))
    return found


@pytest.mark.slow
@needs_wikitext
def test_token_classification_learns_and_writes_run_ner_files(tmp_path, encoder, conll_files):
    from finetune import main

    train, dev, test = conll_files
    tuned = tmp_path / "tuned"
    metrics = main([*common(encoder, tuned), "--do_train", "--do_eval", "--do_predict", "--train_file", str(train),
                    "--validation_file", str(dev), "--test_file", str(test), "--max_steps", "150",
                    "--learning_rate", "3e-3", "--warmup_steps", "10", "--logging_steps", "50"])
    for name in ("train_results.json", "eval_results.json", "predict_results.json", "all_results.json",
                 "trainer_state.json", "predict_results.txt", "model.safetensors", "README.md"):
        assert (tuned / name).is_file(), name
    config = json.loads((tuned / "config.json").read_text())
    assert config["id2label"] == {str(i): name for i, name in enumerate(LABELS)}
    assert config["architectures"] == ["LinformerForTokenClassification"]

    # the model learns the rule: word accuracy above always answering the commonest label
    dev_tags = [tag for line in dev.read_text().splitlines() for tag in json.loads(line)["ner_tags"]]
    majority = Counter(dev_tags).most_common(1)[0][1] / len(dev_tags)
    assert metrics["eval_accuracy"] > majority + 0.05 and metrics["eval_f1"] > 0.3

    # predict_results.txt: one line per test row, one label per word (words past 64 tokens have none)
    rows = [json.loads(line) for line in test.read_text().splitlines()]
    lines = (tuned / "predict_results.txt").read_text().splitlines()
    assert len(lines) == len(rows)
    predicted = [line.split() for line in lines]
    assert all(len(p) == len(r["tokens"]) for p, r in zip(predicted[:-1], rows[:-1]))
    assert 0 < len(predicted[-1]) < len(rows[-1]["tokens"])  # the long row is cut
    assert {tag for p in predicted for tag in p} <= set(LABELS)

    # the predict metrics against an independent count over the words of the file
    truths = [r["ner_tags"][:len(p)] for p, r in zip(predicted, rows)]
    right = sum(g == t for p, r in zip(predicted, truths) for g, t in zip(p, r))
    guessed = {(i, *s) for i, p in enumerate(predicted) for s in spans_bio(p)}
    actual = {(i, *s) for i, t in enumerate(truths) for s in spans_bio(t)}
    results = json.loads((tuned / "predict_results.json").read_text())
    assert results["predict_accuracy"] == pytest.approx(right / sum(map(len, truths)), abs=1e-12)
    assert results["predict_precision"] == pytest.approx(len(guessed & actual) / len(guessed), abs=1e-12)
    assert results["predict_recall"] == pytest.approx(len(guessed & actual) / len(actual), abs=1e-12)

    # evaluation and prediction alone, from the fine-tuned folder: same scores; a test file without labels gives
    # the same lines; the saved tokenizer puts the space before a word, as training did
    unlabelled = write_jsonl(tmp_path / "unlabelled.jsonl", [{"tokens": r["tokens"]} for r in rows])
    again = tmp_path / "again"
    metrics_again = main([*common(tuned, again), "--do_eval", "--do_predict", "--validation_file", str(dev),
                          "--test_file", str(unlabelled), "--return_entity_level_metrics", "True"])
    assert metrics_again["eval_accuracy"] == metrics["eval_accuracy"]
    assert metrics_again["eval_f1"] == metrics["eval_f1"]
    assert {"eval_CAP_f1", "eval_NUM_f1", "eval_CAP_number"} <= set(metrics_again)
    assert metrics_again["eval_CAP_number"] == sum(t == "B-CAP" for t in dev_tags)
    assert (again / "predict_results.txt").read_text().splitlines() == lines
    assert "predict_accuracy" not in metrics_again
    saved = AutoTokenizer.from_pretrained(tuned)
    assert saved.convert_ids_to_tokens(saved("Ada")["input_ids"])[1].startswith("Ġ")

    card = (tuned / "README.md").read_text()
    assert "pipeline_tag: token-classification" in card and 'pipeline("token-classification"' in card
    assert "| accuracy | f1 | precision | recall |\n|---|---|---|---|---|---|---|\n" in card
