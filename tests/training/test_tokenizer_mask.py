"""`<mask>` of the tokenizers trained here (train_bpe_tokenizer) takes the space before it, as RoBERTa's does, so
"in <mask>" is the token sequence that pretraining shows where it masks a word after "in"; the reproduction presets
whose records were made before keep the old tokenizer ("mask_lstrip": false), byte for byte."""

import json
import random
import subprocess
import sys

import pytest
import torch
from helpers import CORPUS, ENV, REPO_ROOT, TINY, WIKITEXT, needs_data
from tokenizers import ByteLevelBPETokenizer
from tokenizers.processors import RobertaProcessing
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, PreTrainedTokenizerFast, pipeline

from hf_linear_attn import LinformerConfig, LinformerForMaskedLM
from experiments.reproduction import ReproductionError, load_preset, plan
from experiments.reproduction.stages import folder_digest, shared_tokenizers
from hf_linear_attn.training.data.corpus import train_bpe_tokenizer

PRESETS = REPO_ROOT / "configs" / "reproduce"
RECORDS = REPO_ROOT / "results" / "reproduction"


@pytest.fixture(scope="module")
def both(tokenizer):
    """{mask_lstrip: tokenizer} trained on the same lines (the conftest tokenizer is the default: lstrip)."""
    return {True: tokenizer, False: train_bpe_tokenizer(CORPUS, TINY["vocab_size"], "roberta", 64, mask_lstrip=False)}


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_in_mask_is_the_in_token_then_the_mask_token(both):
    on, off = both[True], both[False]
    word = _ids(on, "in")
    assert len(word) == 1 and _ids(off, "in") == word  # same vocabulary: only <mask>'s matching differs
    assert _ids(on, "in <mask>") == [*word, on.mask_token_id]
    assert on("in <mask>").input_ids == [on.bos_token_id, *word, on.mask_token_id, on.eos_token_id]
    # without lstrip (the tokenizers trained before): the space is a token of its own, "Ġ", before <mask>
    space = off.convert_tokens_to_ids("Ġ")
    assert _ids(off, "in <mask>") == [*word, space, off.mask_token_id]
    assert _ids(on, "in<mask>") == _ids(off, "in<mask>") == [*word, on.mask_token_id]
    # lstrip only: the space after <mask> stays with the next word, as in RoBERTa ("<mask> Ġthe")
    assert _ids(on, "<mask> the") == [on.mask_token_id, *_ids(on, " the")]


@needs_data
def test_a_masked_word_tokenizes_as_pretraining_masks_it():
    """For real WikiText-2 lines, a word replaced by "<mask>" in the text gives the ids of the unmasked line with
    that word's token replaced by the mask id: exactly the rows that masked-LM pretraining trains on."""
    with open(WIKITEXT / "wiki.valid.tokens") as handle:
        lines = [line.rstrip("\n") for line in handle if line.strip() and not line.strip().startswith("=")
                 and len(line.split()) <= 40][:25]
    with open(WIKITEXT / "wiki.train.tokens") as handle:
        train = [next(handle) for _ in range(2000)]
    on, off = (train_bpe_tokenizer(train, 1000, "roberta", 512, mask_lstrip=flag) for flag in (True, False))
    cases = [(line, words, j) for line in lines for words in [line.split(" ")] for j, word in enumerate(words) if word]
    masked = [" ".join([*words[:j], "<mask>", *words[j + 1:]]) for _, words, j in cases]
    original, prefix, whole = (on([*texts], add_special_tokens=False).input_ids for texts in (
        [line for line, _, _ in cases], [" ".join(words[:j]) for _, words, j in cases],
        [" " + words[j] for _, words, j in cases]))
    with_lstrip, without = (tok(masked, add_special_tokens=False).input_ids for tok in (on, off))
    space, checked = off.convert_tokens_to_ids("Ġ"), 0
    for i, text in enumerate(masked):
        if len(whole[i]) != 1:  # pretraining masks tokens: a word of several is no single <mask>
            continue
        at = len(prefix[i])
        assert original[i][at] == whole[i][0]
        assert with_lstrip[i] == [*original[i][:at], on.mask_token_id, *original[i][at + 1:]], text
        assert without[i] == [*original[i][:at], space, off.mask_token_id, *original[i][at + 1:]], text
        checked += 1
    assert checked > 200


def test_mask_is_declared_as_robertas_and_nothing_else_changes(tmp_path, both):
    """<mask> as RoBERTa's tokenizer declares it (transformers' RobertaTokenizerFast: lstrip, no rstrip, not
    normalized); vocabulary, merges and every other token as without the option."""
    files = {}
    for flag, tok in both.items():
        tok.save_pretrained(tmp_path / str(flag))
        files[flag] = json.loads((tmp_path / str(flag) / "tokenizer.json").read_text())
    mask = next(t for t in files[True]["added_tokens"] if t["content"] == "<mask>")
    assert mask == {"id": both[True].mask_token_id, "content": "<mask>", "single_word": False, "lstrip": True,
                    "rstrip": False, "normalized": False, "special": True}
    for token in files[True]["added_tokens"]:
        if token is not mask:
            assert not token["lstrip"] and not token["rstrip"]
    mask["lstrip"] = False
    assert files[True] == files[False]
    # GPT-2's style has no <mask>: the option changes nothing there
    gpt2 = [train_bpe_tokenizer(CORPUS, TINY["vocab_size"], "gpt2", 64, mask_lstrip=flag) for flag in (True, False)]
    assert gpt2[0].backend_tokenizer.to_str() == gpt2[1].backend_tokenizer.to_str()


def test_lstrip_survives_save_and_load(tmp_path, both):
    for flag, tok in both.items():
        tok.save_pretrained(tmp_path / str(flag))
        for loader in (AutoTokenizer, PreTrainedTokenizerFast):
            loaded = loader.from_pretrained(tmp_path / str(flag))
            assert loaded.added_tokens_decoder[loaded.mask_token_id].lstrip is flag
            assert _ids(loaded, "in <mask>") == _ids(tok, "in <mask>")


@pytest.mark.slow
def test_lstrip_survives_save_and_load_in_a_fresh_process(tmp_path, both):
    both[True].save_pretrained(tmp_path)
    code = ("import sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(t('in <mask>', add_special_tokens=False).input_ids)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False, capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [*_ids(both[True], "in"), both[True].mask_token_id]


def test_an_old_tokenizer_is_switched_over_as_the_docs_say(tmp_path, both):
    """docs/training.md's line for a model pretrained with a tokenizer from before the option."""
    from tokenizers import AddedToken

    both[False].save_pretrained(tmp_path)
    old = AutoTokenizer.from_pretrained(tmp_path)
    old.add_special_tokens({"mask_token": AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False,
                                                     special=True)})
    assert len(old) == len(both[True]) and old.mask_token_id == both[True].mask_token_id
    assert _ids(old, "in <mask>") == _ids(both[True], "in <mask>")
    old.save_pretrained(tmp_path / "switched")
    assert _ids(AutoTokenizer.from_pretrained(tmp_path / "switched"), "in <mask>") == _ids(both[True], "in <mask>")


# ---------------------------------------------------------------------------------------- fill-mask, pretrained

def _sentences(count=8):
    """Short real WikiText-2 sentences with "in the", written as WikiText-2 lines (" ... . "): every line ends in a
    space, so the bare-space token "Ġ" is frequent in pretraining (before each </s>), as it is on WikiText-2."""
    found = []
    with open(WIKITEXT / "wiki.train.tokens") as handle:
        for line in handle:
            for sentence in line.strip().split(" . "):
                if " in the " in sentence and 5 <= len(sentence.split()) <= 9 and not set('"@<=;:.') & set(sentence):
                    found.append(sentence)
            if len(found) == count:
                return found
    return found


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Linformer pretrained with RoBERTa's dynamic masking on the _sentences in shuffled order (rows of 32
    tokens packed as pretrain.py packs them), saved with its lstrip tokenizer; the sentences and the lines."""
    from datasets import Dataset, DatasetDict

    from hf_linear_attn.training.data.corpus import pack_corpus

    sentences = _sentences()
    rng = random.Random(0)
    lines = [f" {rng.choice(sentences)} . " for _ in range(400)]
    tok = train_bpe_tokenizer(lines, 1000, "roberta", 32)
    rows = pack_corpus(DatasetDict(train=Dataset.from_dict({"text": lines})), tok, 32, "mlm")["train"][:]["input_ids"]
    torch.manual_seed(0)
    config = LinformerConfig(**{**TINY, "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                                "linformer_k": 8, "max_position_embeddings": 34, "pad_token_id": 1,
                                "bos_token_id": 0, "eos_token_id": 2})
    model = LinformerForMaskedLM(config)
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    # measured with seeds 0 and 1: "Ġ" is in the top 5 of all eight sentences at step 100, of none from step 200
    for _ in range(400):
        input_ids, labels = collator.torch_mask_tokens(rows[torch.randint(len(rows), (32,), generator=generator)])
        model(input_ids=input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = tmp_path_factory.mktemp("pretrained")
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, sentences, lines


@pytest.mark.slow
@needs_data
def test_fill_mask_on_a_pretrained_model_predicts_words_where_the_mask_is(pretrained):
    folder, sentences, lines = pretrained
    fill = pipeline("fill-mask", model=str(folder), top_k=5)  # the tokenizer as saved: lstrip read back
    old = train_bpe_tokenizer(lines, 1000, "roberta", 32, mask_lstrip=False)
    fill_old = pipeline("fill-mask", model=fill.model, tokenizer=old, top_k=5)
    assert old.get_vocab() == fill.tokenizer.get_vocab()
    space = fill.tokenizer.convert_tokens_to_ids("Ġ")
    for sentence in sentences:
        text = " " + sentence.replace(" in the ", " in <mask> ", 1) + " . "
        predictions = fill(text)
        assert space not in [p["token"] for p in predictions], (text, predictions)
        for p in predictions:  # each candidate stands where the mask was: "in the", never "in  the"
            assert p["sequence"] == text.replace(" <mask>", p["token_str"]), (text, p)
        # the tokenizer without lstrip shows the model "in", "Ġ", <mask>: a word predicted there reads "in  the"
        spaced = [p for p in fill_old(text) if p["token_str"].startswith(" ")]
        assert spaced and all(" in  " in p["sequence"] for p in spaced), (text, spaced)


# --------------------------------------------------------------------------------- reproduction presets

def test_presets_with_committed_records_keep_the_tokenizer_they_were_made_with():
    recorded = {path.parent.name for path in RECORDS.glob("*/records.json")}
    assert recorded >= {"cpu", "demo"}
    for name in recorded & {path.stem for path in PRESETS.glob("*.json")}:
        preset = load_preset(PRESETS / f"{name}.json")
        if preset.get("encoders"):  # <mask> is the masked-LM tokenizer's: a preset of decoders only has none
            assert preset["mask_lstrip"] is False, name
    assert "mask_lstrip" not in load_preset(PRESETS / "paper.json")  # names RoBERTa's tokenizer, lstrip included


def test_mask_lstrip_is_no_stage_argument(tmp_path):
    """The key reaches no stage's arguments: a stage's digested inputs see it only through the tokenizer folder."""
    preset = load_preset(PRESETS / "cpu.json")
    without = plan(preset, tmp_path, tokenizers={"mlm": "TOK", "clm": "TOK2"})
    flipped = plan({**preset, "mask_lstrip": True}, tmp_path, tokenizers={"mlm": "TOK", "clm": "TOK2"})
    assert [s.argv for s in without] == [s.argv for s in flipped]
    assert not any("lstrip" in arg for stage in without for arg in stage.argv if arg.startswith("--"))


def _tiny_preset(tmp_path, **keys):
    (tmp_path / "train.txt").write_text("\n".join(CORPUS))
    (tmp_path / "pre.json").write_text(json.dumps({"train_file": "train.txt", "validation_file": "train.txt",
                                                   "tokenizer_vocab_size": 300, "max_seq_length": 64}))
    return {"root": str(tmp_path), "pretrain": {"config": "pre.json"}, "encoders": {"a": "a.json"}, **keys}


def _tokenizer_as_built_before_the_option(lines, vocab_size, max_length):
    """train_bpe_tokenizer's "roberta" style as it was before mask_lstrip (restated from its history): the
    tokenizer that made the committed records."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False)
    backend = bpe._tokenizer
    backend.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", mask_token="<mask>", cls_token="<s>", sep_token="</s>",
                                   model_max_length=max_length)


def test_mask_lstrip_false_trains_the_tokenizer_of_the_records_byte_for_byte(tmp_path):
    _tokenizer_as_built_before_the_option(CORPUS, 300, 64).save_pretrained(tmp_path / "before")
    kept = shared_tokenizers(_tiny_preset(tmp_path, mask_lstrip=False), tmp_path / "kept", train=True)["mlm"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "kept" / "tokenizer-mlm" / name).read_bytes() == (tmp_path / "before" / name).read_bytes()
    assert folder_digest(tmp_path / "kept" / "tokenizer-mlm") == folder_digest(tmp_path / "before")
    # the default, lstrip, is another tokenizer.json: a stage's recorded inputs would not match it
    new = shared_tokenizers(_tiny_preset(tmp_path), tmp_path / "new", train=True)["mlm"]
    assert folder_digest(tmp_path / "new" / "tokenizer-mlm") != folder_digest(tmp_path / "before")
    kept, new = AutoTokenizer.from_pretrained(kept), AutoTokenizer.from_pretrained(new)
    assert _ids(kept, "in <mask>") == [*_ids(kept, "in"), kept.convert_tokens_to_ids("Ġ"), kept.mask_token_id]
    assert _ids(new, "in <mask>") == [*_ids(new, "in"), new.mask_token_id]


def test_a_tokenizer_folder_with_the_other_setting_is_refused(tmp_path):
    shared_tokenizers(_tiny_preset(tmp_path, mask_lstrip=False), tmp_path / "out", train=True)
    with pytest.raises(ReproductionError, match=r'"mask_lstrip": true.*set "mask_lstrip": false'):
        shared_tokenizers(_tiny_preset(tmp_path), tmp_path / "out", train=False)
    assert shared_tokenizers(_tiny_preset(tmp_path, mask_lstrip=False), tmp_path / "out", train=True)


def test_a_mask_lstrip_that_is_no_boolean_is_refused(tmp_path):
    preset = {**json.loads((PRESETS / "demo.json").read_text()), "mask_lstrip": "false"}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(preset))
    with pytest.raises(ReproductionError, match="'mask_lstrip' must be true or false"):
        load_preset(path, root=REPO_ROOT)


@pytest.mark.slow
@needs_data
def test_the_cpu_presets_tokenizer_has_the_digest_its_records_hold(tmp_path):
    """The cpu preset's shared tokenizer, trained now, is the one whose digest every encoder stage recorded as its
    input: a rerun with --records still takes those stages."""
    records = json.loads((RECORDS / "cpu" / "records.json").read_text())["stages"]
    recorded = {record["inputs"]["$OUTPUT_DIR/tokenizer-mlm"] for record in records.values()
                if "$OUTPUT_DIR/tokenizer-mlm" in record.get("inputs", {})}
    assert len(recorded) == 1
    folder = shared_tokenizers(load_preset(PRESETS / "cpu.json"), tmp_path, train=True)["mlm"]
    assert {folder_digest(tmp_path / "tokenizer-mlm")} == recorded and folder.endswith("tokenizer-mlm")

