"""Masked-LM (encoders) and causal-LM (decoders) pretraining with accelerate, resumable exactly.

Exactness on `--resume` rests on three choices:
- the data order is a permutation drawn from (seed, epoch), and a resumed run skips the batches already consumed
  (`accelerator.skip_first_batches`), so no sampler state has to survive;
- the masked-LM masks of each micro-batch come from a generator seeded by (seed, step, micro-batch, process), not
  from the global RNG, which the data loader's read-ahead would otherwise advance before a checkpoint is taken;
- model, optimizer, scheduler and the global RNGs (dropout) are saved by `accelerator.save_state` into a temporary
  folder that is renamed into place only when complete, so the newest checkpoint is never half written;
- a resume starts only from a checkpoint holding every one of those pieces (`choose_checkpoint`), since accelerate
  skips a missing RNG file without a word (--allow_inexact_resume accepts that, saying so).
Under FSDP (`accelerate launch --config_file configs/accelerate/fsdp-*.yaml`, see fsdp.py) the same checkpoints hold
the model and optimizer as one shard per process; the final model is gathered and saved whole.
"""

import copy
import json
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, LoggerType, set_seed
from torch.utils.data import DataLoader, StackDataset, Subset
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    get_scheduler,
)
from transformers.modeling_outputs import MaskedLMOutput
from transformers.trainer_utils import SchedulerType
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

import hf_linear_attn  # noqa: F401  (registers the package's models with the Auto classes)

from .checkpoints import disk_full_error, fsync_tree, is_disk_full, missing_pieces, remove_folder, replace_folder
from .data import load_text_corpus, pack_corpus, refuse_sources_inside, train_bpe_tokenizer
from .errors import UsageError
from .fsdp import (
    FSDP_STATE_PIECES, check_wrap_classes, checkpoint_layout, fsdp_requested, gathered_state_dict, original_class,
    use_fsdp_on_cpu,
)
from .sources import check_model_source, check_tokenizer_source
from .hub import HUB_ARGUMENTS, SECRET_ARGUMENTS, HubArguments, hub_repo_id, push_folder, write_pretraining_card

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
RUN_ARGS = "run_args.json"
CPUINFO = Path("/proc/cpuinfo")  # where "auto" precision reads the CPU's instruction-set flags
# Arguments a resumed run may change; any other difference would make the continuation a different run.
RESUMABLE_CHANGES = {"max_steps",  # may grow: checked by check_output_dir, the schedule change stated in the log
                     "resume", "resume_from_checkpoint", "overwrite_output_dir", "logging_steps", "report_to",
                     "save_total_limit", "eval_steps", "max_eval_samples", "allow_inexact_resume",
                     *HUB_ARGUMENTS}  # where the result is uploaded; the token is never recorded
# The pieces of state an exact resume needs, each with the file names accelerate may give it (random_states_N.pkl:
# one per process, added by `checkpoint_pieces`).
STATE_PIECES = {"step (trainer_state.json)": ["trainer_state.json"],
                "model weights": ["pytorch_model.bin", "model.safetensors"],
                "optimizer state": ["optimizer.bin"], "learning-rate scheduler": ["scheduler.bin"]}


@dataclass
class PretrainArguments(HubArguments):
    """Arguments of scripts/pretrain.py (every field is a --flag; --config FILE.json gives defaults); the
    --push_to_hub flags come from HubArguments."""

    output_dir: str = field(metadata={"help": "where the model, tokenizer, checkpoints and results go"})
    model_config: str | None = field(default=None, metadata={
        "help": "config of a new model: a JSON file (configs/models/...), a folder or a Hub id"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "continue from these weights instead"})
    objective: str = field(default="auto", metadata={
        "help": "mlm (encoders), clm (decoders) or auto (mlm for any model with a masked-LM head)",
        "choices": ["auto", "mlm", "clm"]})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset, e.g. Salesforce/wikitext"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "e.g. wikitext-2-raw-v1"})
    train_file: str | None = field(default=None, metadata={"help": "local text / json(l) / parquet training file"})
    validation_file: str | None = field(default=None, metadata={"help": "local validation file (same format)"})
    text_column: str = field(default="text")
    validation_split_percentage: float = field(default=5.0, metadata={
        "help": "percentage of train held out for validation when there is no validation split"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={
        "help": "tokenizer folder or Hub id; default: --model_name_or_path's, or (new models) a byte-level BPE "
                "trained on the corpus"})
    tokenizer_vocab_size: int = field(default=8000, metadata={"help": "vocabulary of a tokenizer trained here"})
    max_seq_length: int = field(default=128)
    mlm_probability: float = field(default=0.15)
    per_device_train_batch_size: int = field(default=16)
    per_device_eval_batch_size: int = field(default=16)
    gradient_accumulation_steps: int = field(default=1)
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    learning_rate: float = field(default=5e-4)
    weight_decay: float = field(default=0.01)
    adam_beta1: float = field(default=0.9)
    adam_beta2: float = field(default=0.98)
    adam_epsilon: float = field(default=1e-6)
    max_grad_norm: float = field(default=1.0)
    lr_scheduler_type: str = field(default="linear", metadata={"help": "a transformers schedule: linear, cosine, ..."})
    warmup_ratio: float = field(default=0.06)
    mixed_precision: str = field(default="auto", metadata={
        "help": "no, bf16, fp16, or auto (bf16 where the GPU / CPU has native bf16 arithmetic)",
        "choices": ["auto", "no", "bf16", "fp16"]})
    logging_steps: int = field(default=10)
    eval_steps: int = field(default=200, metadata={"help": "validation perplexity every N steps (and at the end)"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "validate on the first N packed rows"})
    save_steps: int = field(default=200, metadata={"help": "checkpoint every N steps"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept (the newest ones)"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint in output_dir"})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "continue from this checkpoint"})
    allow_inexact_resume: bool = field(default=False, metadata={
        "help": "resume from a checkpoint without its RNG states (dropout and data order then differ from an "
                "uninterrupted run) instead of stopping"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace what output_dir holds"})
    report_to: str = field(default="none", metadata={"help": "accelerate tracker: none, tensorboard, wandb, ..."})
    seed: int = field(default=42)
    trust_remote_code: bool = field(default=False)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX): `cpuinfo` is /proc/cpuinfo's text (read if None)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:  # not Linux: no way to tell, so no claim of native bf16
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_mixed_precision(choice: str) -> str:
    """'auto' -> bf16 where the hardware computes in bf16 natively (CUDA with bf16, CPUs with AVX512-BF16 / AMX)."""
    if choice != "auto":
        return choice
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_has_native_bf16() else "no"


def release_stale_accelerator_state(mixed_precision: str) -> None:
    """Drop an earlier run's AcceleratorState in a single process when it holds another mixed precision.

    accelerate keeps one AcceleratorState per process and refuses a second Accelerator that asks for another
    precision ("AcceleratorState has already been initialized and cannot be changed"). A user (or a test, or a
    benchmark suite) that trains twice in one process, or fine-tunes with Trainer (which leaves its own state)
    before pretraining, would hit that whenever "auto" resolves to bf16. In one process nothing else holds on to
    the old state, so it is dropped; the PartialState (device, process group) is kept. Under a multi-process launch
    the state is shared with the launcher's setup and is left alone: accelerate's own error then names the fix.
    """
    shared = AcceleratorState._shared_state
    if not shared or shared.get("_mixed_precision") in (None, mixed_precision):
        return
    if PartialState._shared_state and PartialState().num_processes > 1:
        return
    AcceleratorState._reset_state(reset_partial_state=False)


def max_model_length(config) -> int:
    """The longest input the model's position table allows."""
    if hasattr(config, "max_sequence_length"):  # this package's encoders
        return config.max_sequence_length
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and config.model_type.startswith(("roberta", "xlm")):
        return config.max_position_embeddings - (config.pad_token_id or 0) - 1  # RoBERTa offsets positions
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def objective_for(config, requested: str) -> str:
    """mlm for models with a masked-LM head, else clm; a requested objective the model cannot do is an error."""
    masked = type(config) in AutoModelForMaskedLM._model_mapping
    causal = type(config) in AutoModelForCausalLM._model_mapping
    if requested == "auto":
        requested = "mlm" if masked else "clm"
    if (requested == "mlm" and not masked) or (requested == "clm" and not causal):
        raise UsageError(f"a {config.model_type} model has no {'masked' if requested == 'mlm' else 'causal'}-LM "
                            "head; choose the other --objective or another model")
    return requested


def check_tokenizer_fits(tokenizer, config, objective: str, new_model: bool) -> None:
    """Raise if the tokenizer's ids do not fit the model (vocabulary size, special ids, mask token)."""
    if objective == "mlm" and tokenizer.mask_token_id is None:
        raise UsageError("masked-LM pretraining needs a tokenizer with a mask token")
    if new_model:
        return
    if len(tokenizer) > config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                            f"{config.vocab_size} rows: use the model's own tokenizer")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ours, theirs = getattr(tokenizer, name), getattr(config, name, None)
        if ours is not None and theirs is not None and ours != theirs:
            raise UsageError(f"tokenizer {name} = {ours} but the model's config has {theirs}: use the model's "
                                "own tokenizer")


def checkpoints_in(output_dir: Path) -> list[Path]:
    """Checkpoint folders step_N, oldest first (temporary folders of an interrupted save are ignored; whether a
    folder is whole is `checkpoint_problems`' question)."""
    folder = output_dir / CHECKPOINTS
    found = [p for p in folder.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def checkpoint_problems(folder: Path, world_size: int, layout: str | None = None,
                        read_content: bool = False) -> dict[str, str]:
    """{piece of state: what is wrong} for a checkpoint folder; empty when an exact resume can start from it.
    `layout`: the run's fsdp_state_dict_type (model and optimizer in FSDP's files), None without FSDP.
    `read_content`: also load the torch files as accelerate will (a resume; the rotation checks headers only)."""
    rng = {f"RNG state of process {i}": [f"random_states_{i}.pkl"] for i in range(world_size)}
    return missing_pieces(folder, {**STATE_PIECES, **FSDP_STATE_PIECES.get(layout, {}), **rng}, read_content)


def trainer_state(step: int, max_steps: int, log_history: list, args: PretrainArguments, world: int) -> dict:
    """trainer_state.json in the shape of Trainer's (global_step, max_steps, log_history, ...); "step" kept for
    checkpoints written before 2026-11-25."""
    return {"global_step": step, "step": step, "max_steps": max_steps, "logging_steps": args.logging_steps,
            "eval_steps": args.eval_steps, "save_steps": args.save_steps,
            "train_batch_size": args.per_device_train_batch_size, "num_processes": world,
            "log_history": log_history}


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, keep: int, state: dict | None = None) -> Path:
    """accelerate state (model, optimizer, scheduler, RNGs) + step into checkpoints/step_N, atomically.

    A failed save (a full disk) removes its temporary folder and leaves the older checkpoints as they were; a full
    disk is reported as a DiskFullError naming the folder."""
    final = output_dir / CHECKPOINTS / f"{STEP_PREFIX}{step:07d}"
    partial = output_dir / CHECKPOINTS / f".partial-{STEP_PREFIX}{step:07d}"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        accelerator.wait_for_everyone()
        # weights as model.safetensors (accelerate drops the tied copies, safetensors' load_model restores them);
        # optimizer, scheduler and RNG states stay torch files, read back by accelerate with weights_only=True.
        # Under FSDP with sharded state dicts every process writes its shard of model and optimizer here too
        # (pytorch_model_fsdp_0/, optimizer_0/), so the rename below publishes all shards at once.
        accelerator.save_state(str(partial), safe_serialization=True)
        if accelerator.is_main_process:
            (partial / "trainer_state.json").write_text(json.dumps(state or {"global_step": step, "step": step},
                                                                   indent=2))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            fsync_tree(partial)
            replace_folder(partial, final)  # a crash leaves either no step_N or a whole one
            for old in checkpoints_in(output_dir)[:-keep] if keep > 0 else []:
                remove_folder(old)  # renamed first: a kill mid-deletion leaves no part of it under its name
    except Exception as error:  # noqa: BLE001  (safetensors raises SafetensorError, no OSError)
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        if is_disk_full(error):
            raise disk_full_error(partial.parent, f"the checkpoint of step {step}", error) from error
        raise
    accelerator.wait_for_everyone()
    return final


def _run_record(args: PretrainArguments, world_size: int, layout: str | None = None) -> dict:
    """What defines a run: the arguments a resumed run must share, the number of processes and, under FSDP, the
    checkpoint layout (max_steps is recorded too, but a resumed run may raise it)."""
    record = {**{k: v for k, v in asdict(args).items() if k not in RESUMABLE_CHANGES}, "num_processes": world_size,
              "max_steps": args.max_steps}
    if layout is not None:  # only under FSDP, so the records of earlier runs still match
        record["fsdp_state_dict_type"] = layout
    return record


def check_output_dir(args: PretrainArguments, world_size: int, layout: str | None = None) -> Path | None:
    """Check the output folder against this run (nothing is written); return the checkpoint to resume from.
    `layout`: this launch's fsdp_state_dict_type (`fsdp.checkpoint_layout`), None without FSDP."""
    output_dir = Path(args.output_dir)
    recorded = _run_record(args, world_size, layout)
    run_file = output_dir / RUN_ARGS
    if args.resume or args.resume_from_checkpoint:
        if not run_file.is_file():
            raise UsageError(f"nothing to resume: {output_dir} holds no run ({RUN_ARGS} is missing)")
        previous = json.loads(run_file.read_text())
        if previous.get("max_steps", args.max_steps) > args.max_steps:
            raise UsageError(f"--resume with --max_steps {args.max_steps}, fewer than the run's "
                             f"{previous['max_steps']}: a run can be extended, not shortened (its learning-rate "
                             "schedule was drawn for the longer run); pass --max_steps "
                             f"{previous['max_steps']} or more")
        changed = sorted(k for k in set(previous) | set(recorded)
                         if k != "max_steps" and previous.get(k) != recorded.get(k))
        if "fsdp_state_dict_type" in changed:  # sharded and whole checkpoints cannot stand in for each other
            def launch(kind):
                return f"under FSDP ({kind})" if kind else "without FSDP"
            raise UsageError(f"the run in {output_dir} was trained {launch(previous.get('fsdp_state_dict_type'))} "
                             f"and this launch is {launch(layout)}: its checkpoints are read only by a launch like "
                             "the one that wrote them (FSDP: accelerate launch --config_file "
                             "configs/accelerate/fsdp-encoder.yaml or fsdp-decoder.yaml, the same "
                             "fsdp_state_dict_type)")
        if changed:
            raise UsageError(f"--resume with different arguments than the run in {output_dir}: "
                                + ", ".join(f"{k}: {previous.get(k)!r} -> {recorded.get(k)!r}" for k in changed))
        candidates = ([Path(args.resume_from_checkpoint)] if args.resume_from_checkpoint
                      else checkpoints_in(output_dir)[::-1])
        if not candidates:  # killed before its first checkpoint was whole: the same command starts it again
            print(f"warning: {output_dir} holds this run but no checkpoint yet; --resume starts it from step 0",
                  flush=True)
            return None
        return choose_checkpoint(candidates, output_dir, world_size, args.allow_inexact_resume,
                                 explicit=bool(args.resume_from_checkpoint), layout=layout)
    if output_dir.exists() and any(output_dir.iterdir()) and not args.overwrite_output_dir:
        raise UsageError(f"{output_dir} is not empty (it holds another run): pass --resume to continue it, "
                            "--overwrite_output_dir to replace it, or choose another --output_dir")
    refuse_sources_inside(output_dir, {"--model_name_or_path": args.model_name_or_path,
                                       "--tokenizer_name_or_path": args.tokenizer_name_or_path,
                                       "--model_config": args.model_config, "--train_file": args.train_file,
                                       "--validation_file": args.validation_file})
    return None


def choose_checkpoint(candidates: list[Path], output_dir: Path, world_size: int, allow_inexact: bool,
                      explicit: bool, layout: str | None = None) -> Path:
    """The first checkpoint of `candidates` (newest first) that holds every piece of state; each one skipped is
    named (and kept). Without a whole one: one missing only RNG states with `allow_inexact`, else an error naming
    what is missing and the flag."""
    damaged = []
    for folder in candidates:
        problems = checkpoint_problems(folder, world_size, layout, read_content=True)
        if not problems:
            for skipped, why in damaged:
                print(f"warning: skipping the incomplete checkpoint {skipped} ({why}); it is left in place")
            return folder
        damaged.append((folder, "; ".join(f"{piece}: {what}" for piece, what in problems.items())))
    if not damaged:
        raise UsageError(f"no complete checkpoint in {output_dir / CHECKPOINTS} to resume from; start again with "
                         "--overwrite_output_dir")
    for folder, _ in damaged:
        problems = checkpoint_problems(folder, world_size, layout, read_content=True)
        if allow_inexact and all(piece.startswith("RNG state") for piece in problems):
            print(f"warning: resuming from {folder} without {', '.join(problems.values())} "
                  "(--allow_inexact_resume): dropout and masks differ from an uninterrupted run")
            return folder
    listing = "\n  ".join(f"{folder}: {why}" for folder, why in damaged)
    fix = ("--allow_inexact_resume accepts a resume without the RNG states (not bit-exact); other pieces cannot be "
           "done without: " + ("choose another --resume_from_checkpoint" if explicit else
                               "start again with --overwrite_output_dir"))
    raise UsageError(f"no checkpoint {'there' if explicit else 'in ' + str(output_dir / CHECKPOINTS)} holds every "
                     f"piece of state an exact resume needs:\n  {listing}\n{fix}")


def verify_restored_rng(accelerator: Accelerator, folder: Path, allow_inexact: bool) -> None:
    """After `load_state`: this process's RNGs must now be the ones its random_states file holds. accelerate loads
    them inside a try whose failure it logs at INFO level only, so a file it could not apply gave an inexact resume,
    exit 0; here that is an error naming --allow_inexact_resume (with it, a warning)."""
    from accelerate.utils import load

    path = folder / f"random_states_{accelerator.process_index}.pkl"
    try:
        saved = load(path, map_location="cpu")
        restored = (torch.equal(torch.get_rng_state(), saved["torch_manual_seed"])
                    and random.getstate() == saved["random_state"]
                    and all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), saved["numpy_random_seed"])))
        why = "they differ from the file's"
    except Exception as error:  # noqa: BLE001  (missing, unreadable or other content: not restored either way)
        restored, why = False, f"{path.name} cannot be read back ({type(error).__name__})"
    if restored:
        return
    if not allow_inexact:
        raise UsageError(f"the RNG states of {folder} were not restored ({why}): the run would not continue as an "
                         "uninterrupted one. Resume from another checkpoint with --resume_from_checkpoint, or pass "
                         "--allow_inexact_resume to continue without them")
    print(f"warning: the RNG states of {folder} were not restored ({why}; --allow_inexact_resume): dropout and masks "
          "differ from an uninterrupted run")


def claim_output_dir(args: PretrainArguments, accelerator: Accelerator) -> dict:
    """Start a new run in output_dir and record its arguments for --resume. What the folder held (replaced with
    --overwrite_output_dir) is moved aside, not deleted, until the run is set up: `release_output_dir` puts it back
    when the run is refused on the way, `drop_replaced_run` deletes it once training starts."""
    output_dir = Path(args.output_dir)
    recorded = _run_record(args, accelerator.num_processes, checkpoint_layout(accelerator))
    claim = {"existed": output_dir.exists(), "moved_to": None}
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if output_dir.exists() and any(output_dir.iterdir()):
            moved_to = output_dir.with_name(f".replaced-{output_dir.name}")
            shutil.rmtree(moved_to, ignore_errors=True)
            os.replace(output_dir, moved_to)
            claim["moved_to"] = moved_to
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUN_ARGS).write_text(json.dumps(recorded, indent=2))
    accelerator.wait_for_everyone()
    return claim


def release_output_dir(args: PretrainArguments, accelerator: Accelerator, claim: dict) -> None:
    """Undo `claim_output_dir` for a refused run: output_dir as it was found (absent, empty or the old run)."""
    if accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        shutil.rmtree(output_dir, ignore_errors=True)
        if claim["moved_to"] is not None:
            os.replace(claim["moved_to"], output_dir)
        elif claim["existed"]:
            output_dir.mkdir()


def drop_replaced_run(accelerator: Accelerator, claim: dict | None) -> None:
    """Delete the run --overwrite_output_dir replaced, once the new one is set up."""
    if claim is not None and claim["moved_to"] is not None and accelerator.is_main_process:
        shutil.rmtree(claim["moved_to"], ignore_errors=True)


def check_arguments(args: PretrainArguments, objective: str) -> None:
    """Every numeric flag in its range, before anything is read or written (a bad one used to crash mid-run, or
    worse, train and report NaN)."""
    shortest = 3 if objective == "mlm" else 2  # <s> token </s>; a token and the next one to predict
    if args.max_seq_length < shortest:
        raise UsageError(f"--max_seq_length must be at least {shortest} for {objective} (got {args.max_seq_length}): "
                         + ("a row is <s>, at least one token and </s>" if objective == "mlm"
                            else "a row needs a token and the next one to predict"))
    at_least_one = {"--max_steps": args.max_steps, "--gradient_accumulation_steps": args.gradient_accumulation_steps,
                    "--per_device_train_batch_size": args.per_device_train_batch_size,
                    "--per_device_eval_batch_size": args.per_device_eval_batch_size,
                    "--logging_steps": args.logging_steps, "--eval_steps": args.eval_steps,
                    "--save_steps": args.save_steps}
    if args.max_eval_samples is not None:
        at_least_one["--max_eval_samples"] = args.max_eval_samples
    for flag, value in at_least_one.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})" + (
                "; to skip checkpoints, pass a --save_steps beyond --max_steps" if flag == "--save_steps" else ""))
    if not 0.0 < args.mlm_probability <= 1.0 and objective == "mlm":
        raise UsageError(f"--mlm_probability must be in (0, 1] (got {args.mlm_probability}): with no masked token "
                         "there is no loss (RoBERTa uses 0.15)")
    if not 0.0 <= args.warmup_ratio <= 1.0:
        raise UsageError(f"--warmup_ratio must be between 0 and 1 (got {args.warmup_ratio}): the share of "
                         "--max_steps spent warming up the learning rate")
    if args.learning_rate <= 0 or not math.isfinite(args.learning_rate):
        raise UsageError(f"--learning_rate must be a positive number (got {args.learning_rate})")
    schedules = [kind.value for kind in SchedulerType]
    if args.lr_scheduler_type not in schedules:  # else get_scheduler raised only after the folder was claimed
        raise UsageError(f"--lr_scheduler_type {args.lr_scheduler_type!r} is not a Transformers schedule: choose "
                         f"one of {schedules}")
    if args.save_total_limit < 0:
        raise UsageError(f"--save_total_limit must be 0 (keep all) or more (got {args.save_total_limit})")
    if args.tokenizer_name_or_path is None and args.model_name_or_path is None:
        # a byte-level BPE starts from the 256 byte symbols and the special tokens: below that nothing is learnt
        smallest = 256 + (5 if objective == "mlm" else 2)
        if args.tokenizer_vocab_size < smallest:
            raise UsageError(f"--tokenizer_vocab_size must be at least {smallest} (got {args.tokenizer_vocab_size}): "
                             "a byte-level BPE holds the 256 bytes and the special tokens before any merge")


def load_tokenizer(args: PretrainArguments, accelerator: Accelerator, corpus, style: str, resuming: bool):
    """The given tokenizer, or (main process) a byte-level BPE trained on the corpus, saved into output_dir."""
    output_dir = Path(args.output_dir)
    if args.tokenizer_name_or_path is not None or args.model_name_or_path is not None:
        source = args.tokenizer_name_or_path or args.model_name_or_path  # existing weights: their own tokenizer
        check_tokenizer_source(source, "--tokenizer_name_or_path" if args.tokenizer_name_or_path
                               else "--model_name_or_path (its tokenizer; or pass --tokenizer_name_or_path)")
    else:
        source = str(output_dir)
        if not resuming and accelerator.is_main_process:
            tokenizer = train_bpe_tokenizer(corpus["train"]["text"], args.tokenizer_vocab_size, style,
                                            args.max_seq_length)
            tokenizer.save_pretrained(output_dir)
        accelerator.wait_for_everyone()
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot load a tokenizer from {source}: {error}") from error


def load_model_config(args: PretrainArguments):
    """The config of --model_config or --model_name_or_path (exactly one of them)."""
    if (args.model_config is None) == (args.model_name_or_path is None):
        raise UsageError("pass exactly one of --model_config (a new model) and --model_name_or_path (weights)")
    source = args.model_config or args.model_name_or_path
    check_model_source(source, "--model_config" if args.model_config else "--model_name_or_path")
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot read a model config from {source}: {error}") from error


def build_model(args: PretrainArguments, config, tokenizer, objective: str):
    """A new model from --model_config (sized to the tokenizer) or the weights of --model_name_or_path."""
    source = args.model_config or args.model_name_or_path
    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    new_model = args.model_config is not None
    check_tokenizer_fits(tokenizer, config, objective, new_model)
    if new_model:
        # a new model takes the tokenizer's vocabulary and special ids
        config.vocab_size = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name) is not None:
                setattr(config, name, getattr(tokenizer, name))
    if args.max_seq_length > max_model_length(config):
        raise UsageError(f"--max_seq_length {args.max_seq_length} is longer than the model allows "
                            f"({max_model_length(config)} positions): lower it or give the config more positions")
    if new_model:
        return auto.from_config(config, trust_remote_code=args.trust_remote_code)
    try:
        return auto.from_pretrained(source, config=config, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot load {objective} weights from {source}: {error}") from error


class MaskedTokensLoss(torch.nn.Module):
    """A masked LM whose output head runs on the masked tokens only, as fairseq computes RoBERTa's loss.

    `forward(input_ids, labels).loss` is `model(input_ids, labels=labels).loss` (mean cross-entropy over labels !=
    -100) without the (batch, n, vocab) logits of the ~85% of tokens that carry no label: at a vocabulary of 8,000
    and width 256 those logits and their log-softmax were half of a CPU training step. For models with a base model
    and an `lm_head` module (RoBERTa and this package's encoders); `supports` says whether a model has them.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    @staticmethod
    def supports(model) -> bool:
        return isinstance(getattr(model, "lm_head", None), torch.nn.Module) and model.base_model is not model

    def forward(self, input_ids, labels=None, attention_mask=None):
        """input_ids, labels (batch, n) -> MaskedLMOutput with the loss only; without labels the model's own output
        (every token's logits), which is how evaluation runs under FSDP: only the root module's forward gathers the
        sharded weights outside the layers (embeddings, LM head)."""
        if labels is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask)
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        picked = labels != -100
        logits = self.model.lm_head(hidden[picked])  # (masked tokens, vocab)
        return MaskedLMOutput(loss=torch.nn.functional.cross_entropy(logits, labels[picked]))


def _optimizer(model, args: PretrainArguments):
    """AdamW without weight decay on biases and LayerNorm weights (the RoBERTa / GPT-2 recipe)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon)


class BatchStream:
    """Training batches forever, epoch after epoch, each epoch a permutation drawn from (seed, epoch).

    `start(consumed)` positions the stream after `consumed` micro-batches of this process, which is how a resumed
    run finds its place in the data without any saved sampler state.
    """

    def __init__(self, accelerator: Accelerator, dataset, batch_size: int, seed: int):
        self.accelerator, self.dataset, self.batch_size, self.seed = accelerator, dataset, batch_size, seed
        self.per_epoch = len(self._loader(0))
        if self.per_epoch == 0:
            raise UsageError(f"{len(dataset)} training rows do not make one batch of {batch_size} per process; "
                                "lower --per_device_train_batch_size or add data")

    def _loader(self, epoch: int):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))
        # A loader without its own generator draws a seed from the global RNG each time it is iterated, which
        # would shift the dropout stream of a resumed run (its loaders start at different times).
        loader = DataLoader(Subset(self.dataset, order.tolist()), batch_size=self.batch_size, drop_last=True,
                            generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.accelerator.prepare_data_loader(loader)

    def start(self, consumed: int):
        epoch, skip = divmod(consumed, self.per_epoch)
        while True:
            loader = self._loader(epoch)
            if skip:
                loader = self.accelerator.skip_first_batches(loader, skip)
            yield from loader
            epoch, skip = epoch + 1, 0


def _mask(batch, tokenizer, args: PretrainArguments, seed: int):
    """RoBERTa's dynamic masking (15%: 80% <mask>, 10% random, 10% kept) with a generator seeded by `seed`."""
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability, seed=seed)
    masked = collator([{"input_ids": row} for row in batch["input_ids"].cpu()])
    return {k: v.to(batch["input_ids"].device) for k, v in masked.items() if k in ("input_ids", "labels")}


def _items(batch, objective: str) -> int:
    """Tokens the loss averages over: masked tokens (mlm) or predicted next tokens (clm)."""
    if objective == "mlm":
        return int((batch["labels"] != -100).sum())
    return int((batch["labels"][:, 1:] != -100).sum())


@torch.no_grad()
def evaluate_perplexity(model, accelerator: Accelerator, rows: dict, batch_size: int, objective: str) -> dict:
    """Validation loss (mean over all predicted tokens of all processes) and its exp, the perplexity."""
    model.eval()
    loader = accelerator.prepare_data_loader(DataLoader(StackDataset(**rows), batch_size=batch_size,
                                                        generator=torch.Generator().manual_seed(0)))
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in loader:
        with accelerator.autocast():  # the training precision, whether or not `model` is the prepared module
            logits = model(input_ids=batch["input_ids"]).logits.float()
        labels = batch["labels"]
        if objective == "clm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        per_row = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(-1)
        tokens = (labels != -100).sum(-1)
        # gather_for_metrics drops the rows repeated to make the last batch even across processes
        per_row, tokens = accelerator.gather_for_metrics((per_row, tokens))
        loss_sum += per_row.double().sum()
        count += tokens.double().sum()
    model.train()
    loss = (loss_sum / count).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "eval_tokens": int(count.item())}


def check_accelerator_arguments(args: PretrainArguments, on_cpu: bool) -> None:
    """The flags the Accelerator itself takes, checked before it is made: a bad tracker was a bare ValueError from
    accelerate, and fp16 on a CPU ran in float32 while the results said fp16."""
    trackers = ["none", *LoggerType.list()]
    if args.report_to not in trackers:
        raise UsageError(f"--report_to {args.report_to!r} is not an accelerate tracker: choose one of {trackers}")
    if args.mixed_precision == "fp16" and on_cpu:
        raise UsageError("--mixed_precision fp16 needs a GPU: on a CPU accelerate runs float32 instead without a "
                         "word; pass --mixed_precision bf16 (native on CPUs with AVX512-BF16 / AMX), no, or auto "
                         "(bf16 where the CPU computes it natively, else no)")


def make_accelerator(args: PretrainArguments) -> Accelerator:
    """The run's Accelerator: mixed precision and trackers as `args` say; FSDP when the launcher asks for it, on
    GPUs by accelerate itself, without GPUs by `use_fsdp_on_cpu` (accelerate would run plain data parallel)."""
    # Without cpu=True accelerate treats several launched processes on a CPU-only machine as independent runs.
    on_cpu = not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))
    check_accelerator_arguments(args, on_cpu)
    mixed_precision = resolve_mixed_precision(args.mixed_precision)
    release_stale_accelerator_state(mixed_precision)
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=mixed_precision,
                              log_with=None if args.report_to == "none" else args.report_to,
                              project_dir=args.output_dir)
    if on_cpu and fsdp_requested() and accelerator.distributed_type == DistributedType.MULTI_CPU:
        use_fsdp_on_cpu(accelerator)
    return accelerator


def check_fsdp_wrapping(accelerator: Accelerator, config, objective: str, args: PretrainArguments) -> None:
    """Under FSDP, the accelerate config's layer classes checked against a weightless (meta-device) copy of the
    model, before any data is read or anything written."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(copy.deepcopy(config), trust_remote_code=args.trust_remote_code)
    check_wrap_classes(accelerator, skeleton)


def prepare_model_and_data(args: PretrainArguments, accelerator: Accelerator, config, objective: str,
                           resume_from: Path | None, claim: dict | None = None):
    """(tokenizer, model, packed corpus, validation source, claim): the inputs read first, and only then output_dir
    claimed (`claim_output_dir`); a run refused later is to `release_output_dir` the claim."""
    with accelerator.main_process_first():
        corpus, validation_source = load_text_corpus(
            args.dataset_name, args.dataset_config_name, args.train_file, args.validation_file, args.text_column,
            args.validation_split_percentage, args.seed)
    if resume_from is None:  # the inputs are readable: only now is output_dir claimed
        claim = claim_output_dir(args, accelerator)
    try:
        tokenizer = load_tokenizer(args, accelerator, corpus, "roberta" if objective == "mlm" else "gpt2",
                                   resuming=resume_from is not None)
        set_seed(args.seed)  # the same initial weights whatever the tokenizer training consumed
        model = build_model(args, config, tokenizer, objective)
        with accelerator.main_process_first():
            packed = pack_corpus(corpus, tokenizer, args.max_seq_length, objective)
    except Exception:  # a refusal, or any other failure before training: the folder as it was found
        if claim is not None:
            release_output_dir(args, accelerator, claim)
        raise
    return tokenizer, model, packed, validation_source, claim


def evaluation_rows(validation, tokenizer, args: PretrainArguments, objective: str) -> dict:
    """The validation batch every evaluation scores: for masked LM one fixed masking, the same for every
    evaluation and every model."""
    if args.max_eval_samples is not None:  # at least 1 (check_arguments)
        validation = validation.select(range(min(args.max_eval_samples, len(validation))))
    ids = validation[:]["input_ids"]  # one (rows, seq_len) tensor
    if objective == "mlm":
        return _mask({"input_ids": ids}, tokenizer, args, seed=args.seed + 1)
    return {"input_ids": ids, "labels": ids.clone()}


def prepare_training(args: PretrainArguments, accelerator: Accelerator, model, objective: str):
    """(trained module, optimizer, scheduler), prepared by accelerate. The trained module is the masked LM with its
    head on masked tokens only where the model allows it, else the model itself."""
    optimizer = _optimizer(model, args)
    world = accelerator.num_processes
    # accelerate steps a prepared scheduler once per process per optimizer step: scale its lengths to match
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                              num_warmup_steps=math.ceil(args.warmup_ratio * args.max_steps) * world,
                              num_training_steps=args.max_steps * world)
    trained = MaskedTokensLoss(model) if objective == "mlm" and MaskedTokensLoss.supports(model) else model
    return accelerator.prepare(trained, optimizer, scheduler)


def optimizer_step(accelerator: Accelerator, trained, optimizer, scheduler, micro: list[dict], objective: str,
                   max_grad_norm: float) -> tuple[torch.Tensor, int]:
    """One optimizer step over the micro-batches of every process; returns (this process's loss x tokens, the
    tokens of every process). The step's loss is the mean over every predicted token of every process."""
    world = accelerator.num_processes
    counts = [_items(b, objective) for b in micro]
    total = accelerator.reduce(torch.tensor(sum(counts), device=accelerator.device), "sum").item()
    loss_sum = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(micro):
        sync = i == len(micro) - 1
        with nullcontext() if sync else accelerator.no_sync(trained):
            loss = trained(**batch).loss
            # DDP averages gradients over processes, hence * world
            accelerator.backward(loss * (counts[i] * world / max(total, 1)))
        loss_sum += loss.detach().float() * counts[i]
    if max_grad_norm > 0:
        accelerator.clip_grad_norm_(trained.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss_sum, total


def run_pretraining(args: PretrainArguments) -> dict:
    """Pretrain as `args` say; returns the final metrics (also written to output_dir/train_results.json)."""
    accelerator = make_accelerator(args)
    repo_id = hub_repo_id(args, accelerator)  # token, Hub, repo name: before any data or model work
    config = load_model_config(args)
    objective = objective_for(config, args.objective)
    check_arguments(args, objective)
    check_fsdp_wrapping(accelerator, config, objective, args)
    resume_from = check_output_dir(args, accelerator.num_processes, checkpoint_layout(accelerator))
    output_dir = Path(args.output_dir)
    set_seed(args.seed)
    tokenizer, model, packed, validation_source, claim = prepare_model_and_data(args, accelerator, config,
                                                                                objective, resume_from)
    try:  # a refusal up to the first step leaves output_dir as it was found
        eval_rows = evaluation_rows(packed["validation"], tokenizer, args, objective)
        trained, optimizer, scheduler = prepare_training(args, accelerator, model, objective)
        stream_source = BatchStream(accelerator, packed["train"], args.per_device_train_batch_size, args.seed)
    except Exception:  # a refusal, or any other failure before training: the folder as it was found
        if claim is not None:
            release_output_dir(args, accelerator, claim)
        raise
    drop_replaced_run(accelerator, claim)
    world = accelerator.num_processes
    # Under FSDP the weights outside the layers are gathered only by the prepared (root) module's forward
    evaluated = trained if accelerator.distributed_type == DistributedType.FSDP else model

    start_step, log_history = 0, []
    if resume_from is not None:
        try:
            accelerator.load_state(str(resume_from))
        except Exception as error:  # a file damaged in a way the header checks cannot see
            raise UsageError(f"cannot load the checkpoint {resume_from}: {type(error).__name__}: {error}. Resume "
                             "from an older one with --resume_from_checkpoint") from error
        verify_restored_rng(accelerator, resume_from, args.allow_inexact_resume)
        saved_state = json.loads((resume_from / "trainer_state.json").read_text())
        start_step = saved_state.get("global_step", saved_state["step"])
        log_history = list(saved_state.get("log_history", []))
        accelerator.print(f"resumed from {resume_from} at step {start_step}")
        previous_max = json.loads((output_dir / RUN_ARGS).read_text()).get("max_steps", args.max_steps)
        if start_step >= args.max_steps:
            raise UsageError(f"the checkpoint {resume_from} is at step {start_step}, --max_steps is {args.max_steps}: "
                             "nothing left to train; pass a larger --max_steps to continue")
        if previous_max != args.max_steps:
            inner = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps the LambdaLR
            lr_next = (inner.lr_lambdas[0](inner.last_epoch) * inner.base_lrs[0] if hasattr(inner, "lr_lambdas")
                       else inner.get_last_lr()[0])
            accelerator.print(
                f"--max_steps raised from {previous_max} to {args.max_steps}: the learning-rate schedule "
                f"({args.lr_scheduler_type}, warmup {args.warmup_ratio:g} of the steps) is now drawn over "
                f"{args.max_steps} steps; the learning rate after step {start_step} is {lr_next:.3g} "
                f"(it was {scheduler.get_last_lr()[0]:.3g} under the {previous_max}-step schedule)")
            if accelerator.is_main_process:
                record = json.loads((output_dir / RUN_ARGS).read_text())
                (output_dir / RUN_ARGS).write_text(json.dumps({**record, "max_steps": args.max_steps}, indent=2))
    if args.report_to != "none":
        accelerator.init_trackers("pretrain", config={k: v for k, v in asdict(args).items()
                                                      if isinstance(v, (int, float, str, bool))
                                                      and k not in SECRET_ARGUMENTS})
    accelerator.print(f"{objective} pretraining of {type(model).__name__} "
                      f"({sum(p.numel() for p in model.parameters()):,} parameters) on {len(packed['train'])} rows "
                      f"of {args.max_seq_length} tokens, {world} process(es), mixed precision "
                      f"{accelerator.mixed_precision}")

    stream = stream_source.start(start_step * args.gradient_accumulation_steps)
    progress = tqdm(total=args.max_steps, initial=start_step, disable=not accelerator.is_local_main_process,
                    desc="pretraining")
    model.train()
    metrics, started = {}, time.perf_counter()
    running_loss = torch.zeros((), device=accelerator.device)  # this process's loss x tokens since the last log
    running_items = 0  # tokens of every process since the last log
    for step in range(start_step, args.max_steps):
        micro = [next(stream) for _ in range(args.gradient_accumulation_steps)]
        if objective == "mlm":
            micro = [_mask(b, tokenizer, args, seed=args.seed * 1_000_003 + (step * len(micro) + i) * world
                           + accelerator.process_index) for i, b in enumerate(micro)]
        else:
            micro = [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in micro]
        loss_sum, items = optimizer_step(accelerator, trained, optimizer, scheduler, micro, objective,
                                         args.max_grad_norm)
        running_loss += loss_sum
        running_items += items
        progress.update(1)
        done = step + 1
        if done % args.logging_steps == 0 or done == args.max_steps:
            # reduced only here: no extra synchronisation in the steps between logs
            loss_sum = accelerator.reduce(running_loss, "sum").item()
            logs = {"loss": loss_sum / max(running_items, 1), "learning_rate": scheduler.get_last_lr()[0]}
            running_loss.zero_()
            running_items = 0
            progress.set_postfix(loss=f"{logs['loss']:.3f}")
            accelerator.log(logs, step=done)
            log_history.append({**logs, "step": done})
        if done % args.eval_steps == 0 or done == args.max_steps:
            metrics = evaluate_perplexity(evaluated, accelerator, eval_rows, args.per_device_eval_batch_size,
                                          objective)
            accelerator.log(metrics, step=done)
            log_history.append({**metrics, "step": done})
            if accelerator.is_main_process:
                progress.write(f"step {done}: validation loss {metrics['eval_loss']:.4f}, "
                               f"perplexity {metrics['perplexity']:.2f}")
        if done % args.save_steps == 0 and done != args.max_steps:
            save_checkpoint(accelerator, output_dir, done, args.save_total_limit,
                            trainer_state(done, args.max_steps, log_history, args, world))
    progress.close()

    accelerator.wait_for_everyone()
    results = {**metrics, "objective": objective, "steps": args.max_steps, "validation": validation_source,
               "train_rows": len(packed["train"]), "num_processes": world,
               "mixed_precision": accelerator.mixed_precision,
               "seconds_this_session": round(time.perf_counter() - started, 1)}
    full_state = gathered_state_dict(accelerator, trained, model)  # FSDP: every process sends its shards
    if accelerator.is_main_process:
        try:
            # the module inside `trained`, trained in place; under FSDP its whole weights gathered above
            with original_class(model):
                model.save_pretrained(output_dir, state_dict=full_state)
            tokenizer.model_max_length = max_model_length(model.config)  # the model's limit, not this run's length
            tokenizer.save_pretrained(output_dir)
            (output_dir / "train_results.json").write_text(json.dumps(results, indent=2))
            (output_dir / "trainer_state.json").write_text(
                json.dumps(trainer_state(args.max_steps, args.max_steps, log_history, args, world), indent=2))
        except Exception as error:  # noqa: BLE001  (safetensors raises SafetensorError, no OSError)
            if is_disk_full(error):
                raise disk_full_error(output_dir, "the final model", error) from error
            raise
    accelerator.wait_for_everyone()
    # end_training destroys the process group: the DDP wrapper (its reducer holds the group) goes first. Freed after
    # the group, the reducer joined gloo threads that never ended: a 2-process run hung there at exit (seen once).
    trained = evaluated = optimizer = scheduler = stream = stream_source = None
    accelerator.free_memory()
    accelerator.end_training()
    if accelerator.is_main_process:  # after end_training: no process waits at a barrier through a long upload
        write_pretraining_card(output_dir, args, repo_id or Path(args.output_dir).resolve().name)
        if repo_id is not None:
            results["hub_commit"] = push_folder(
                output_dir, repo_id, token=args.hub_token, private=args.hub_private_repo,
                commit_message="Upload pretrained model, tokenizer and model card",
                ignore=(f"{CHECKPOINTS}/**", "pretrain/**"))  # resume state; accelerate trackers' logs
    return results
