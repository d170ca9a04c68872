"""Checkpoints that are whole or ignored: file checks, atomic folder replacement, full-disk reporting.

Both scripts write checkpoints into a temporary folder and rename it into place when complete, so a kill or a full
disk never leaves a half-written checkpoint under a checkpoint's name; `remove_folder` deletes one the same way
round. A folder damaged some other way (a file deleted or truncated by hand, a checkpoint of an older version) is
found by `missing_pieces` and skipped by name.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import sys
import zipfile
from pathlib import Path

from .errors import DiskFullError, UsageError


def file_problem(path: Path) -> str | None:
    """Why `path` is not a whole file ("missing", "empty", "truncated"), or None. Cheap: reads headers only.

    torch.save files (.bin, .pt, .pth, .pkl) are zip archives whose directory sits at the end, so a truncated one
    is no zip; a safetensors file must be as long as its header says; JSON must parse.
    """
    if path.is_dir():  # an FSDP shard set (torch.distributed.checkpoint folder)
        return sharded_folder_problem(path)
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size == 0:
        return "empty"
    suffix = path.suffix
    if suffix in (".bin", ".pt", ".pth", ".pkl"):
        return None if zipfile.is_zipfile(path) else "truncated or not a torch file"
    if suffix == ".safetensors":
        try:
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(handle.read(length))
            if not isinstance(header, dict):
                raise TypeError("header is not a table")
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, UnicodeDecodeError, TypeError, KeyError, IndexError):
            return "truncated or not a safetensors file (unreadable header)"
        return None if size >= 8 + length + end else "truncated (shorter than its header says)"
    if suffix == ".json":
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            return "truncated or not JSON"
    return None


def sharded_folder_problem(folder: Path) -> str | None:
    """Why a torch.distributed.checkpoint folder (FSDP's sharded model or optimizer) is not whole, or None: its
    .metadata must load and every shard file it names must reach the last byte it records there."""
    if not (folder / ".metadata").is_file():
        return "holds no .metadata"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(folder)).read_metadata().storage_data
        ends = {}
        for item in storage.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    except Exception as error:  # noqa: BLE001  (a truncated pickle fails in many ways; each makes it unusable)
        return f"has an unreadable .metadata ({type(error).__name__})"
    for name, end in sorted(ends.items()):
        if not (folder / name).is_file():
            return f"lacks {name}"
        if (folder / name).stat().st_size < end:
            return f"has a truncated {name} (shorter than its .metadata says)"
    return None


# What the libraries read back from each RNG file (accelerate's random_states_N.pkl, Trainer's rng_state*.pth): a
# file without these keys is skipped by accelerate with an INFO log line (the run then resumes inexactly, exit 0) and
# fails Trainer with a bare KeyError.
RNG_KEYS = {"random_states": ("random_state", "numpy_random_seed", "torch_manual_seed"),
            "rng_state": ("python", "numpy", "cpu")}


def content_problem(path: Path) -> str | None:
    """Why a whole torch file cannot be read back as the libraries read it, or None. Reads the file (memory-mapped):
    for a resume only, not for every rotation. torch files must load with weights_only=True (accelerate and Trainer
    load them so: a pickle that needs other globals was an UnpicklingError traceback); RNG files must hold every
    state the libraries restore (a valid file with other content used to give an inexact resume without a word)."""
    if path.suffix not in (".bin", ".pt", ".pth", ".pkl") or path.is_dir() or not path.is_file():
        return None
    from accelerate.utils import load  # torch.load with weights_only=True and accelerate's numpy globals allowed

    try:
        try:
            content = load(path, map_location="cpu", mmap=True)  # no copy of a large optimizer state in memory
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            content = load(path, map_location="cpu")  # a file of torch's older format: read it whole
    except Exception as error:  # noqa: BLE001  (a refused or damaged pickle fails in many ways)
        # torch's weights_only message is a page of advice with terminal colours; its first sentence and the
        # global it refused say what is wrong
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        picked = [lines[0], *(line for line in lines if line.startswith("WeightsUnpickler error"))] if lines else []
        reason = "; ".join(dict.fromkeys(line.split(". ")[0] for line in picked))[:300]
        return f"unreadable ({type(error).__name__}{': ' + reason if reason else ''})"
    kind = next((k for k in RNG_KEYS if path.name.startswith(k)), None)
    if kind is not None:
        missing = [key for key in RNG_KEYS[kind] if not isinstance(content, dict) or key not in content]
        if missing:
            return f"holds no RNG state ({', '.join(missing)} missing)"
    return None


def missing_pieces(folder: Path, pieces: dict[str, list[str]], read_content: bool = False) -> dict[str, str]:
    """{piece: "file: problem"} for each piece of state ({piece: alternative file or shard-folder names}) with no
    whole file; `read_content`: torch files must also load as the libraries load them (`content_problem`)."""
    found = {}
    for piece, names in pieces.items():
        problems = []
        for name in names:
            problem = file_problem(folder / name)
            if problem is None and read_content:
                problem = content_problem(folder / name)
            problems.append((name, problem))
        if all(problem is not None for _, problem in problems):
            name, problem = next(((n, p) for n, p in problems if p != "missing"), problems[0])
            found[piece] = f"{name} {problem}"
    return found


def fsync_tree(folder: Path) -> None:
    """Flush every file of `folder` to disk (a rename is only as durable as what it renames)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def replace_folder(partial: Path, final: Path) -> None:
    """Rename the complete folder `partial` onto `final` (replacing an older `final`): atomic for the name `final`."""
    stale = final.with_name(f".stale-{final.name}")
    if final.exists():  # a run resumed from an older checkpoint reaches the steps it had saved before
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
    os.replace(partial, final)
    shutil.rmtree(stale, ignore_errors=True)


def remove_folder(folder: Path) -> None:
    """Delete `folder` so that a kill half-way never leaves part of it under its own name: it is renamed to
    .deleting-NAME first (a name no checkpoint listing matches), then removed. What earlier kills left half deleted
    beside it goes too (a whole checkpoint's worth of disk, else kept for good)."""
    for leftover in folder.parent.glob(".deleting-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    doomed = folder.with_name(f".deleting-{folder.name}")
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# How a full disk reads when a library's native code meets it, by message (none of these is an OSError):
# torch's zip writer ("unexpected pos ...", "file write failed"), torch.save through a C++ stream ("basic_ios::clear:
# iostream error", how Trainer's torch.save of optimizer.pt / training_args.bin fails), safetensors' Rust writer
# ("SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)").
DISK_FULL_MESSAGES = ("unexpected pos", "file write failed", "basic_ios::clear", "No space left on device",
                      "os error 28", "Disk quota exceeded", "os error 122")


def is_disk_full(error: BaseException) -> bool:
    """Whether an exception chain comes from a full disk: ENOSPC / EDQUOT, or the message a library's native writer
    gives for it (`DISK_FULL_MESSAGES`: torch's zip writer and C++ streams, safetensors)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(error) for s in DISK_FULL_MESSAGES):
            return True
        error = error.__cause__ or error.__context__
    return False


def disk_full_error(folder: Path, what: str, error: BaseException) -> DiskFullError:
    """The error a script reports for a full disk, naming the folder and the free space."""
    try:
        free = f"{shutil.disk_usage(folder if folder.exists() else folder.parent).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(f"the disk is full: {what} could not be written to {folder} ({free}; {error}). Free some "
                         "space (or choose another --output_dir) and run again; a run with checkpoints continues "
                         "with --resume (pretrain.py) / --resume_from_checkpoint True (finetune.py)")


@contextlib.contextmanager
def script_errors(output_dir_of):
    """How the training scripts end on a refusal: a UsageError exits with "error: ..." and no traceback, and a full
    disk wherever it strikes (results files, the card, a tokenizer, a tracker's log; whatever library raised it)
    exits naming the run's folder, ``output_dir_of()`` (None before the arguments are read: then it is raised as
    is). The checkpoint and final-model saves name their own folder."""
    try:
        yield
    except UsageError as error:
        sys.exit(f"error: {error}")
    except Exception as error:
        folder = output_dir_of()
        if folder is None or not is_disk_full(error):
            raise
        sys.exit(f"error: {disk_full_error(Path(folder), 'the run', error)}")
