"""Where the scripts read a model config, weights or a tokenizer from: a local file or folder, checked here with an
error naming what is missing and the fix, or a Hub id, passed on to Transformers.

Transformers' own messages for local trouble point elsewhere: a missing folder is reported as a bad Hub repo id
("Repo id must be in the form 'repo_name' or 'namespace/repo_name'"), a folder with only tokenizer_config.json as a
missing sentencepiece / tiktoken install, and a config.json without "model_type" as a need for trust_remote_code.
"""

import json
from pathlib import Path

from .errors import UsageError

# The files a tokenizer folder needs besides tokenizer_config.json: one of these sets (fast tokenizer, byte-level
# BPE, WordPiece, sentencepiece).
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("vocab.txt",), ("spiece.model",),
                   ("sentencepiece.bpe.model",), ("tokenizer.model",))


def looks_local(source: str) -> bool:
    """Whether `source` can only be a local path (a Hub id is 'name' or 'owner/name', with no file suffix)."""
    path = Path(source)
    return (path.exists() or path.is_absolute() or source.startswith((".", "~")) or source.count("/") > 1
            or path.suffix.lower() == ".json" or "\\" in source)


def check_model_source(source: str, flag: str) -> None:
    """An error naming `flag` for a local config / model path that is missing or holds a config without a model type.
    Hub ids pass unchecked."""
    if not looks_local(source):
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise UsageError(f"{flag} {source}: no such file or folder (a Hub id reads 'name' or 'owner/name'); check "
                         "the path")
    config_file = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config_file.is_file():
        raise UsageError(f"{flag} {source}: the folder holds no config.json; pass the folder a model was saved in "
                         "(save_pretrained writes config.json and the weights)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"{flag} {source}: {config_file.name} is not readable JSON ({error}); a truncated file? "
                         "write it again") from error
    if not isinstance(config, dict) or "model_type" not in config:
        raise UsageError(f"{flag} {source}: {config_file.name} has no \"model_type\" key, so no config class can "
                         "read it; add one (\"linformer\", \"linear_roberta\", \"linear_gpt2\", \"linformer_gpt2\", "
                         "\"roberta\", \"gpt2\", ...)")


def check_tokenizer_source(source: str, flag: str) -> None:
    """An error naming `flag` for a local tokenizer folder that is missing or lacks the tokenizer's own files."""
    if not looks_local(source):
        return
    path = Path(source).expanduser()
    if not path.is_dir():
        raise UsageError(f"{flag} {source}: no such folder; pass the folder a tokenizer was saved in "
                         "(tokenizer.save_pretrained) or a Hub id")
    if not any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILES):
        present = sorted(p.name for p in path.iterdir())[:8]
        raise UsageError(f"{flag} {source} holds no tokenizer files (it has {present}): a tokenizer needs "
                         "tokenizer.json, or vocab.json and merges.txt (byte-level BPE), or vocab.txt (WordPiece); "
                         "save it again with tokenizer.save_pretrained, or pass another --tokenizer_name_or_path")
