"""A pretraining run's folder: its record (run_args.json, what a resume must share), its checkpoints (whole or
skipped by name, written atomically) and the choice of the one an exact resume starts from.

Exactness on `--resume` rests on these choices (the others, data order and masks, are the loop's):
- model, optimizer, scheduler and the global RNGs (dropout) are saved by `accelerator.save_state` into a temporary
  folder that is renamed into place only when complete, so the newest checkpoint is never half written;
- a resume starts only from a checkpoint holding every one of those pieces, each readable as accelerate reads it
  (`choose_checkpoint`), since accelerate skips a missing or unreadable RNG file without a word
  (--allow_inexact_resume accepts that, saying so), and the restored RNG states are checked after loading
  (`verify_restored_rng`).
"""

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

from .checkpoints import disk_full_error, fsync_tree, is_disk_full, missing_pieces, remove_folder, replace_folder
from .data.files import refuse_sources_inside
from .errors import UsageError
from .fsdp import FSDP_STATE_PIECES, checkpoint_layout
from .hub import HUB_ARGUMENTS
from .pretraining_arguments import PretrainArguments

CHECKPOINTS = "checkpoints"


STEP_PREFIX = "step_"


RUN_ARGS = "run_args.json"
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


def run_record(args: PretrainArguments, world_size: int, layout: str | None = None) -> dict:
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
    recorded = run_record(args, world_size, layout)
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
    recorded = run_record(args, accelerator.num_processes, checkpoint_layout(accelerator))
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
