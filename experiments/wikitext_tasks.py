"""Small question answering and multiple choice sets built from real WikiText-2 text, for trying
`scripts/finetune.py --task_type question_answering / multiple_choice` offline (scripts/make_wikitext_tasks.py).

They are synthetic tasks over real text, not SQuAD or SWAG, and their scores say nothing about either:

- question answering, in the `datasets` squad format: the context is a WikiText-2 paragraph; the question is one of
  its sentences with a number or a run of capitalised words (a name) replaced by "what number" / "what" (a cloze
  question, not a natural one); the answer is the replaced span, with its character offset in the paragraph.
- multiple choice, in SWAG's columns: `sent1` is a sentence of a paragraph, `sent2` the first words of the sentence
  that follows it, and the four endings are the rest of that sentence and the rests of three sentences drawn from
  other articles; `label` is the true one's index.

Train sets come from wiki.train.tokens, validation sets from wiki.valid.tokens (other articles). The text is
WikiText's tokenized text with its number separators joined again ("1 @,@ 000" -> "1,000"); "<unk>" stays. The
files are written where the caller says (never into the checkout: the data is ../shared/data's, CC BY-SA 3.0)."""

import csv
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from hf_linear_attn.training.errors import UsageError

SOURCES = {"train": "wiki.train.tokens", "validation": "wiki.valid.tokens"}
NUMBER = re.compile(r"^(?:\d[\d,.]*\d|\d)$")
NAME_WORD = re.compile(r"^[A-Z](?:[A-Za-z'-]*[A-Za-z])?$")
SENTENCE_END = re.compile(r" [.?!](?= |$)")


def clean(line: str) -> str:
    """WikiText-2's tokenized text with its split numbers and hyphens joined again ("1 @,@ 000" -> "1,000")."""
    return line.strip().replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")


@dataclass
class Paragraph:
    """A paragraph of an article, and its sentences as (start, end) character spans (each with its full stop)."""

    title: str
    article: int
    text: str
    sentences: list


def paragraphs(path: Path):
    """The paragraphs of a WikiText file, each with the title of its article (headings are not paragraphs)."""
    title, article = "", -1
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            if line.startswith("="):
                if not line.startswith("= ="):  # " = Title = " begins an article; " = = Section = = " does not
                    title, article = line.strip("= ").strip(), article + 1
                continue
            text = clean(line)
            spans, start = [], 0
            for end in SENTENCE_END.finditer(text):
                spans.append((start, end.end()))
                start = end.end() + 1
            if start < len(text):
                spans.append((start, len(text)))
            yield Paragraph(title, article, text, spans)


def starts_a_sentence(text: str) -> bool:
    """Whether a span begins like a sentence (a capital or a digit): WikiText splits abbreviations ("lit . Valkyria"),
    so some spans between full stops are fragments."""
    return bool(text) and (text[0].isupper() or text[0].isdigit())


def answer_candidates(words: list[str]) -> list[tuple[int, int, str]]:
    """The (first word, word after the last, kind) of each number and each run of capitalised words of a sentence,
    the sentence's first word aside (it is capitalised anyway)."""
    found, index = [], 1
    while index < len(words):
        if NUMBER.match(words[index]):
            found.append((index, index + 1, "number"))
            index += 1
        elif NAME_WORD.match(words[index]):
            end = index + 1
            while end < len(words) and NAME_WORD.match(words[end]):
                end += 1
            found.append((index, end, "name"))
            index = end
        else:
            index += 1
    return found


def word_spans(text: str) -> list[tuple[int, int]]:
    """The character spans of the space-separated words of a text."""
    return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]


def cloze_question(sentence: str, first: int, last: int, kind: str) -> tuple[str, str, int]:
    """(question, answer, the answer's character offset in the sentence): words first..last-1 replaced by "what" (a
    name) or "what number", the full stop by a question mark."""
    spans = word_spans(sentence)
    start, end = spans[first][0], spans[last - 1][1]
    asked = sentence[:start] + ("what number" if kind == "number" else "what") + sentence[end:]
    asked = re.sub(r" [.?!]$", "", asked.rstrip()) + " ?"
    return asked, sentence[start:end], start


def build_qa_rows(path: Path, count: int, seed: int, split: str, questions_per_paragraph: int = 2,
                  context_words: tuple[int, int] = (40, 250), question_words: tuple[int, int] = (6, 25)) -> list[dict]:
    """`count` SQuAD-format rows (id, title, context, question, answers) from the paragraphs of a WikiText file, in
    file order, at most `questions_per_paragraph` per paragraph (distinct sentences), chosen with `seed`."""
    rng, rows = random.Random(seed), []
    for paragraph in paragraphs(path):
        if not context_words[0] <= len(paragraph.text.split()) <= context_words[1]:
            continue
        options = []
        for start, end in paragraph.sentences:
            words = paragraph.text[start:end].split()
            candidates = answer_candidates(words)
            if question_words[0] <= len(words) <= question_words[1] and candidates and \
                    starts_a_sentence(paragraph.text[start:end]):
                options.append((start, end, candidates))
        for start, end, candidates in rng.sample(options, min(questions_per_paragraph, len(options))):
            first, last, kind = rng.choice(candidates)
            question, answer, offset = cloze_question(paragraph.text[start:end], first, last, kind)
            rows.append({"id": f"wikitext2-{split}-{len(rows):05d}", "title": paragraph.title,
                         "context": paragraph.text, "question": question,
                         "answers": {"text": [answer], "answer_start": [start + offset]}})
            if len(rows) == count:
                return rows
    return rows


def build_choice_rows(path: Path, count: int, seed: int, split: str, endings: int = 4, prefix_words: int = 2,
                      sentence_words: tuple[int, int] = (6, 40)) -> list[dict]:
    """`count` SWAG-style rows (id, title, sent1, sent2, ending0..ending{endings-1}, label): one pair of consecutive
    sentences per paragraph, in file order; the distractors are the rests of sentences of other articles."""
    rng = random.Random(seed)
    pairs, pool = [], []  # (paragraph, sentence, next sentence); (article, sentence) of every usable sentence
    for paragraph in paragraphs(path):
        if len(pairs) == count and paragraph.article > pairs[-1][0].article + 3:
            break  # the pool holds the sentences of three more articles, to draw distractors from
        sentences = [paragraph.text[s:e] for s, e in paragraph.sentences]
        usable = [sentence_words[0] <= len(s.split()) <= sentence_words[1] and starts_a_sentence(s) for s in sentences]
        pool.extend((paragraph.article, s) for s, ok in zip(sentences, usable) if ok)
        options = [(sentences[i], sentences[i + 1]) for i in range(len(sentences) - 1) if usable[i] and usable[i + 1]]
        if options and len(pairs) < count:
            pairs.append((paragraph, *rng.choice(options)))
    rows = []
    for paragraph, sentence, following in pairs:
        words = following.split()
        if len({s for a, s in pool if a != paragraph.article}) < endings - 1:
            raise UsageError(f"{path.name} holds too few sentences outside the article {paragraph.title!r} to draw "
                             f"{endings - 1} wrong endings from")
        others = []
        while len(others) < endings - 1:
            article, other = rng.choice(pool)
            rest = " ".join(other.split()[prefix_words:])
            if article != paragraph.article and rest not in others:
                others.append(rest)
        choices = [" ".join(words[prefix_words:]), *others]
        order = list(range(endings))
        rng.shuffle(order)
        row = {"id": f"wikitext2-{split}-{len(rows):05d}", "title": paragraph.title, "sent1": sentence,
               "sent2": " ".join(words[:prefix_words])}
        row.update({f"ending{i}": choices[k] for i, k in enumerate(order)})
        row["label"] = order.index(0)
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows as JSON lines (.jsonl), a JSON list (.json) or CSV (.csv, flat rows only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with open(path, "w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    else:
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def build_sets(data_dir: Path, output_dir: Path, qa_counts=(2000, 300), choice_counts=(2000, 300),
               seed: int = 0) -> dict:
    """Write qa/{train,validation}.jsonl and choice/{train,validation}.csv under output_dir from WikiText-2 in
    data_dir (../shared/data/wikitext-2), with a provenance.json; {name: path} of the files written."""
    data_dir, output_dir = Path(data_dir), Path(output_dir)
    for name in SOURCES.values():
        if not (data_dir / name).is_file():
            raise UsageError(f"WikiText-2 not found: no {data_dir / name} (see ../shared/data/README.md; pass "
                             "--data_dir)")
    written, sizes = {}, {}
    for split, (qa_count, choice_count) in zip(SOURCES, zip(qa_counts, choice_counts)):
        source = data_dir / SOURCES[split]
        qa = build_qa_rows(source, qa_count, seed, split)
        choice = build_choice_rows(source, choice_count, seed, split)
        for kind, rows, wanted in (("qa", qa, qa_count), ("choice", choice, choice_count)):
            if len(rows) < wanted:
                raise UsageError(f"{source.name} gives only {len(rows)} {kind} rows, fewer than the {wanted} asked for")
        written[f"qa_{split}"] = write_rows(output_dir / "qa" / f"{split}.jsonl", qa)
        written[f"choice_{split}"] = write_rows(output_dir / "choice" / f"{split}.csv", choice)
        sizes[split] = {"qa": len(qa), "choice": len(choice)}
    provenance = {"what": "synthetic question answering (cloze questions, SQuAD format) and multiple choice (true "
                          "next sentence among 4, SWAG columns) sets built from WikiText-2 text; not SQuAD or SWAG",
                  "sources": {split: str(data_dir / name) for split, name in SOURCES.items()}, "seed": seed,
                  "rows": sizes, "license": "WikiText-2: CC BY-SA 3.0 (Merity et al. 2016)",
                  "builder": "experiments/wikitext_tasks.py (scripts/make_wikitext_tasks.py)"}
    (output_dir / "provenance.json").write_text(json.dumps(provenance, indent=2), encoding="utf-8")
    return written
