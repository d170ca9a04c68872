"""Pretraining text: a corpus of lines (Hub dataset or local files), a byte-level BPE tokenizer trained on it, and
the corpus packed into full rows of the sequence length (RoBERTa's FULL-SENTENCES)."""

from datasets import DatasetDict
from tokenizers import AddedToken, ByteLevelBPETokenizer
from tokenizers.processors import RobertaProcessing, TemplateProcessing
from transformers import PreTrainedTokenizerFast

from ..errors import UsageError
from .files import carve_validation, load_hub, load_local, warn_same_file, require_columns, require_text


def load_text_corpus(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                     text_column="text", validation_split_percentage=5.0, seed=42,
                     text_pair_column=None) -> tuple[DatasetDict, str]:
    """Train / validation text (non-empty rows of `text_column`) from a Hub dataset or local text / json / parquet /
    csv / tsv; with `text_pair_column`, sentence pairs (rows where both columns hold text, e.g. GLUE's TSVs).

    Returns the DatasetDict (one column "text", and "text_pair" with pairs) and a description of where the
    validation split came from.
    """
    if dataset_name is None and train_file is None:
        raise UsageError("no data: pass --dataset_name (a Hub dataset) or --train_file (local text / json / parquet / "
                         "csv / tsv)")
    if dataset_name is not None:
        raw = load_hub(dataset_name, dataset_config_name)
    else:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        raw = load_local(files, allowed=("text", "json", "parquet", "csv"))
    if "train" not in raw:
        raise UsageError(f"the dataset has no train split (splits: {list(raw)})")
    raw = DatasetDict({split: raw[split] for split in ("train", "validation") if split in raw})
    columns = [text_column] + ([text_pair_column] if text_pair_column else [])
    require_columns(raw, tuple(columns), "the text (set --text_column" + (" / --text_pair_column)" if text_pair_column
                                                                          else ")"))
    raw = raw.select_columns(columns)
    for split, part in raw.items():
        require_text(part, columns, split, "give every row a string (empty lines are skipped) or choose "
                                           "another --text_column")
    warn_same_file(train_file, validation_file)  # after the files' own checks, which name worse problems
    names = ["text", "text_pair"][: len(columns)]
    if columns != names:
        raw = raw.rename_columns(dict(zip(columns, names)))
    raw = raw.filter(lambda batch: [all(isinstance(t, str) and t.strip() != "" for t in texts)
                                    for texts in zip(*(batch[name] for name in names))], batched=True)
    if "validation" in raw:
        return raw, "validation"
    carved = carve_validation(raw, validation_split_percentage, seed)
    return carved, f"{validation_split_percentage}% of train (seed {seed})"


def train_bpe_tokenizer(lines, vocab_size: int, style: str, model_max_length: int,
                        mask_lstrip: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `lines`: RoBERTa's special tokens (style "roberta") or GPT-2's.

    `mask_lstrip` (style "roberta"; GPT-2's has no mask token): `<mask>` takes the space before it, declared as
    RoBERTa's own tokenizer declares it (lstrip, no rstrip, not normalized). Then "in <mask>" is "in" + `<mask>`,
    the two tokens pretraining shows where it masks "Ġthe" after "in"; without it, it is "in" + "Ġ" + `<mask>`, a
    sequence pretraining never shows, and fill-mask predicts off-distribution. False keeps the tokenizer that the
    recorded reproduction presets were trained with (configs/reproduce: "mask_lstrip"): its tokenizer.json, whose
    digest their records check, stays byte for byte the same. Only added-token matching changes: the vocabulary,
    the merges and the ids of any text without a literal "<mask>" are the same either way.
    """
    bpe = ByteLevelBPETokenizer()
    # a plain string when off: exactly the token (and tokenizer.json) of the tokenizers trained before the option
    mask = AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False, special=True) if mask_lstrip else "<mask>"
    if style == "roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>", mask]
    elif style == "gpt2":
        specials = ["<|endoftext|>", "<pad>"]
    else:
        raise UsageError(f"unknown tokenizer style {style!r}: use 'roberta' or 'gpt2'")
    # the trainer adds the special tokens to the backend with their flags: lstrip lands in tokenizer.json
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2, special_tokens=specials, show_progress=False)
    backend = bpe._tokenizer
    if style == "roberta":
        backend.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
        return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="<pad>", mask_token=mask, cls_token="<s>", sep_token="</s>",
                                       model_max_length=model_max_length)
    # GPT-2 adds no special tokens to a single text; a pair is joined by <|endoftext|> so the model sees the boundary.
    backend.post_processor = TemplateProcessing(single="$A", pair="$A <|endoftext|> $B",
                                                special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<pad>", model_max_length=model_max_length)


def pack_corpus(corpus: DatasetDict, tokenizer, seq_len: int, objective: str) -> DatasetDict:
    """Full-sentence packing: each split's lines, joined by the eos token, cut into rows of exactly seq_len tokens.

    Rows may cross line / document boundaries (RoBERTa's FULL-SENTENCES). Masked-LM rows are <s> + seq_len - 2
    tokens + </s>; causal-LM rows are seq_len tokens of the stream. The tail of each batch of 1000 lines that does
    not fill a row is dropped (as in the Transformers example scripts).
    """
    if tokenizer.eos_token_id is None or (objective == "mlm" and tokenizer.bos_token_id is None):
        raise UsageError("the tokenizer has no eos (and, for masked LM, bos) token to separate and frame rows")
    body = seq_len - 2 if objective == "mlm" else seq_len

    def group(batch):
        stream = []
        for ids in tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(tokenizer.eos_token_id)
        rows = [stream[i: i + body] for i in range(0, len(stream) - body + 1, body)]
        if objective == "mlm":
            rows = [[tokenizer.bos_token_id, *row, tokenizer.eos_token_id] for row in rows]
        return {"input_ids": rows}

    packed = corpus.map(group, batched=True, batch_size=1000, remove_columns=["text"], desc="packing")
    for split, part in packed.items():
        if len(part) == 0:
            raise UsageError(f"the {split} text is shorter than one row of {seq_len} tokens; lower --max_seq_length")
    return packed.with_format("torch")
