"""Trainer checkpoints that are whole or absent: `AtomicCheckpointTrainer` writes each checkpoint-N into a temporary
folder and renames it into place, rotates by step, and names a full disk; `resolve_resume` finds the checkpoint an
exact resume starts from (each file read as Trainer reads it), skipping incomplete ones by name. Under FSDP
(`fsdp.TrainerFSDPMixin`) the model and optimizer are FSDP's files (`fsdp.FSDP_STATE_PIECES`), and a checkpoint is
resumed only under the layout that wrote it. It also evaluates and predicts in row order whatever the training
sampler (`_get_eval_sampler`)."""

import re
import shutil
from pathlib import Path

from torch.utils.data import SequentialSampler
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, has_length

from .checkpoints import disk_full_error, fsync_tree, is_disk_full, missing_pieces, remove_folder, replace_folder
from .errors import UsageError
from .fsdp import FSDP_STATE_PIECES, TrainerFSDPMixin, checkpoint_layout

CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


INTERRUPTED_SAVE = (".partial-", ".stale-", ".deleting-")  # temporary folders a killed save can leave


class AtomicCheckpointTrainer(TrainerFSDPMixin, Trainer):
    """A Trainer whose checkpoint-N folders are whole or absent: each is written into a temporary folder
    (.partial-checkpoint-N/checkpoint-N, which Trainer's own `get_last_checkpoint` does not match) and renamed into
    place when complete; a full disk is reported as such, the older checkpoints untouched. FSDP also without GPUs
    (`TrainerFSDPMixin`): every process writes its shards into the same temporary folder."""

    def _get_eval_sampler(self, eval_dataset):
        """Rows in their order. Transformers 5 also groups evaluation and prediction batches by length when training
        does (train_sampling_strategy "group_by_length"), so predictions come back in another order than the rows:
        harmless where labels travel with each batch (accuracy), wrong wherever outputs are matched to rows by
        position (question answering's windows -> answers, predict_results.txt)."""
        grouped = self.args.train_sampling_strategy == "group_by_length"
        if not grouped or eval_dataset is None or not has_length(eval_dataset):
            return super()._get_eval_sampler(eval_dataset)
        # Trainer's own choice without grouping: sequential on one process, the accelerator's split on several
        return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None

    def _save_checkpoint(self, model, trial):
        run_dir = Path(self._get_output_dir(trial=trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_dir / f".partial-{name}"
        final = run_dir / name
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        get_output_dir = self._get_output_dir
        self._get_output_dir = lambda trial=None: str(staging)  # Trainer's save (and rotation) happen in staging
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every process's RNG state is in staging
            if self.args.should_save:
                if self.state.best_model_checkpoint and Path(self.state.best_model_checkpoint).parent == staging:
                    self.state.best_model_checkpoint = str(run_dir / Path(self.state.best_model_checkpoint).name)
                    self.state.save_to_json(str(staging / name / "trainer_state.json"))
                fsync_tree(staging)
                replace_folder(staging / name, final)
                shutil.rmtree(staging, ignore_errors=True)
                self._keep_newest_checkpoints(run_dir, final)
        except Exception as error:  # noqa: BLE001  (safetensors raises SafetensorError, no OSError)
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            if is_disk_full(error):
                raise disk_full_error(run_dir, f"the checkpoint {name}", error) from error
            raise
        finally:
            self._get_output_dir = get_output_dir
        self.accelerator.wait_for_everyone()

    def _keep_newest_checkpoints(self, run_dir: Path, saved: Path) -> None:
        """Keep the --save_total_limit newest whole checkpoints (and the one just saved, and the best one).

        Not Trainer's rotate_checkpoints: it orders by modification time and deletes in place, so a kill during a
        deletion left a half-deleted checkpoint-N whose folder was now the newest by time; the next rotation kept
        it and deleted whole, newer ones. Here the order is the step (as for resuming), incomplete folders are
        neither counted nor deleted (they are skipped by name and kept), and each deletion is atomic."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        layout = checkpoint_layout(self.accelerator)
        whole = [p for p in checkpoint_folders(run_dir)
                 if not trainer_checkpoint_problems(p, self.args.world_size, layout=layout)]
        protected = {saved}
        if self.state.best_model_checkpoint:
            protected.add(Path(self.state.best_model_checkpoint))
        excess = len(whole) - max(limit, len(protected))
        for folder in whole:  # oldest first
            if excess <= 0:
                break
            if folder not in protected:
                remove_folder(folder)
                excess -= 1


def trainer_checkpoint_problems(folder: Path, world_size: int, read_content: bool = False,
                                layout: str | None = None) -> dict[str, str]:
    """{piece of state: what is wrong} for a Trainer checkpoint; empty when an exact resume can start from it.
    `read_content`: also load the torch files as Trainer will (a resume; the rotation checks headers only).
    `layout`: the run's fsdp_state_dict_type (model and optimizer in FSDP's files), None without FSDP."""
    pieces = {"step and trainer state": ["trainer_state.json"],
              "model weights": ["model.safetensors", "pytorch_model.bin"],
              "optimizer state": ["optimizer.pt", "optimizer.bin"], "learning-rate scheduler": ["scheduler.pt"],
              **FSDP_STATE_PIECES.get(layout, {})}
    if world_size == 1:
        pieces["RNG state"] = ["rng_state.pth"]
    else:
        pieces.update({f"RNG state of process {i}": [f"rng_state_{i}.pth"] for i in range(world_size)})
    return missing_pieces(folder, pieces, read_content)


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """The checkpoint-N folders of output_dir, oldest step first (temporary .partial- / .stale- / .deleting- folders
    are not matched; whether a folder is whole is `trainer_checkpoint_problems`' question)."""
    found = [p for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and CHECKPOINT_NAME.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.match(p.name).group(1)))


def written_layout(folder: Path) -> str | None:
    """How a Trainer checkpoint holds model and optimizer: "SHARDED_STATE_DICT" or "FULL_STATE_DICT" (FSDP's files),
    "none" (without FSDP: optimizer.pt), None when none of these files is there to tell."""
    if (folder / "pytorch_model_fsdp_0").exists() or (folder / "optimizer_0").exists():
        return "SHARDED_STATE_DICT"
    if (folder / "pytorch_model_fsdp.bin").exists():
        return "FULL_STATE_DICT"
    return "none" if (folder / "optimizer.pt").exists() else None


def refuse_other_layout(folder: Path, layout: str | None) -> None:
    """Refuse a checkpoint written under another layout than this launch's: sharded, whole-file FSDP and ordinary
    checkpoints cannot stand in for each other (Trainer stops only after the data are read, or reads none of the
    FSDP files: "Checkpoint found at ... is only supported when using PyTorch FSDP")."""
    written = written_layout(folder)
    if written is None or written == (layout or "none"):
        return

    def launch(kind):
        return f"under FSDP ({kind})" if kind not in (None, "none") else "without FSDP"

    raise UsageError(f"{folder} was written {launch(written)} and this launch is {launch(layout)}: a checkpoint is "
                     "read only by a launch like the one that wrote it (FSDP: accelerate launch --config_file "
                     "configs/accelerate/fsdp-encoder.yaml or fsdp-decoder.yaml, or Trainer's --fsdp flags, with the "
                     "same fsdp_state_dict_type)")


def resolve_resume(value: str | None, output_dir: Path, world_size: int, allow_inexact: bool,
                   layout: str | None = None) -> str | None:
    """The checkpoint --resume_from_checkpoint means: a folder (checked whole), or with True / latest the newest
    whole checkpoint-N of output_dir, each incomplete one skipped by name (and kept). An error names what a
    checkpoint lacks and --allow_inexact_resume, which accepts one lacking only RNG states. `layout`: this
    launch's fsdp_state_dict_type (`fsdp.trainer_checkpoint_layout`), None without FSDP; a checkpoint written under
    another is refused."""
    if value is None or str(value).lower() in ("", "false", "none"):
        return None
    if str(value).lower() in ("true", "latest"):
        candidates = checkpoint_folders(output_dir)[::-1]
        if not candidates:
            # A run killed before its first checkpoint was whole leaves nothing, or only the temporary folder of
            # that save: the same command then starts the run (so one command serves a first try and every retry).
            # A folder holding anything else is another run's.
            present = sorted(p.name for p in output_dir.iterdir()) if output_dir.is_dir() else []
            others = [name for name in present if not name.startswith(INTERRUPTED_SAVE)]
            if others:
                raise UsageError(f"--resume_from_checkpoint {value}: {output_dir} holds no {PREFIX_CHECKPOINT_DIR}-N "
                                 f"folder to resume from, but other files ({', '.join(others[:5])}): another run's "
                                 "output? Choose another --output_dir, or --overwrite_output_dir without "
                                 "--resume_from_checkpoint to replace it")
            print(f"warning: --resume_from_checkpoint {value}: {output_dir} holds no checkpoint yet; training from "
                  "the start")
            return None
    else:
        candidates = [Path(value)]
        if not candidates[0].is_dir():
            raise UsageError(f"--resume_from_checkpoint {value}: no such checkpoint folder")
    damaged = []
    for folder in candidates:
        refuse_other_layout(folder, layout)
        problems = trainer_checkpoint_problems(folder, world_size, read_content=True, layout=layout)
        if not problems or (allow_inexact and all(p.startswith("RNG state") for p in problems)):
            for skipped, why in damaged:
                print(f"warning: skipping the incomplete checkpoint {skipped} ({why}); it is left in place")
            if problems:
                print(f"warning: resuming from {folder} without its {', '.join(problems)} "
                      f"({'; '.join(problems.values())}; --allow_inexact_resume): the continuation differs from an "
                      "uninterrupted run")
            return str(folder)
        damaged.append((folder, "; ".join(f"{piece}: {what}" for piece, what in problems.items())))
    listing = "\n  ".join(f"{folder}: {why}" for folder, why in damaged)
    raise UsageError(f"no checkpoint to resume from holds every piece of state an exact resume needs:\n  {listing}\n"
                     "--allow_inexact_resume accepts one without its RNG states; without weights, optimizer or "
                     "scheduler choose another --resume_from_checkpoint folder or start again")
