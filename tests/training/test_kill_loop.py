"""Issue 30: SIGKILL (and once a full disk) at seeded-random moments of checkpoint saves, in a loop, and the same
command run again each time: the run always finishes, in one attempt more than there were stops; no retry fails to
find a checkpoint; no incomplete folder ever carries a checkpoint's name, and those a resume passes over are named
and left in place; older whole checkpoints stay byte for byte as written (only the rotation to --save_total_limit
removes one); the final weights equal those of an uninterrupted run, bit for bit (the README promises it for
pretraining; fine-tuning resumes Trainer's own RNG, data order and optimizer state on CPU, and is found exact too).

Each attempt is a process forked from one that imported the libraries (tests/training/kill_during_saves.py), which
kills itself (or finds the disk full) at the n-th file operation of one phase of one save: inside the library's
save (a weights or optimizer file half written), while the package finishes a save (the rename into place, the
clean-up), or while it deletes an old checkpoint. Where in that phase is drawn from a seeded generator
(KILL_LOOP_SEED, default 0: set it to try other moments); the operation each stop hit is in the assertion messages.
"""

import hashlib
import json
import os
import random
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, ENV, TINY, needs_data, pretrain_args, tiny_preset, weights
from safetensors.torch import load_file

SEED = int(os.environ.get("KILL_LOOP_SEED", "0"))
# (save of the attempt, where in it, kill or full disk): a kill inside the library's own save of the first checkpoint
# (nothing whole on disk yet), one while the third save deletes the oldest checkpoint, a full disk in the middle of a
# file, a kill while a resumed run puts its first save in place
STOPS = [(1, "writing", "kill"), (3, "rotation", "kill"), (2, "writing", "full"), (1, "finishing", "kill")]
CANNOT_RESUME = "Can't find a valid checkpoint"


class Attempts:
    """The client of kill_during_saves.py: one attempt per call, its exit status, output and logged operations."""

    def __init__(self, folder: Path):
        self.folder, self.count = folder, 0
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("kill_during_saves.py"))],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)

    def run(self, script: str, argv: list, kill=None, timeout=300):
        self.count += 1
        log, output = self.folder / f"events-{self.count}.jsonl", self.folder / f"output-{self.count}.txt"
        request = {"script": script, "argv": [str(a) for a in argv], "kill": kill, "log": str(log),
                   "output": str(output)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        assert ready, f"attempt {self.count} ran past {timeout} s"
        status = json.loads(self.server.stdout.readline())["status"]
        events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return status, output.read_text(), events

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=60)


@pytest.fixture
def attempts(tmp_path):
    runner = Attempts(tmp_path)
    yield runner
    runner.close()


def step_named(path: str) -> int | None:
    """The step of a checkpoint folder's path (checkpoint-N, step_000000N, or a temporary folder of one)."""
    found = re.search(r"(?:checkpoint-|step_)(\d+)$", path)
    return int(found.group(1)) if found else None


def choose_kill(census: list[dict], save: int, where: str, rng: random.Random):
    """[save, phase, n]: an operation drawn from `where` in `census`, the operations of the uninterrupted run's save
    of the step that the attempt's save number `save` reaches (the same operations, in the same order).
    writing: a torch / safetensors file inside the library's save; finishing: the package's own operations after
    it (the rename into place, the clean-up), up to the rotation; rotation: the deletion of old checkpoints."""
    step = step_named(census[0]["path"])  # each save starts by clearing its temporary folder
    last_library = max(i for i, e in enumerate(census) if e["phase"] == "library")
    rotation = next((i for i, e in enumerate(census) if i > last_library and e["kind"] in ("os.rename", "shutil.rmtree")
                     and step_named(e["path"]) not in (None, step)), len(census))
    pools = {
        "writing": [e for e in census if e["phase"] == "library" and e["kind"] in ("torch.save", "safetensors")],
        "finishing": census[last_library + 1: rotation],
        "rotation": census[rotation:],
    }
    assert pools[where], f"no '{where}' operation in the save of step {step}: {census}"
    chosen = rng.choice(pools[where])
    return [save, chosen["phase"], chosen["n"]]


def census_by_save(events: list[dict]) -> dict[int, list[dict]]:
    saves = {}
    for event in events:
        saves.setdefault(event["save"], []).append(event)
    return saves


def digest(folder: Path) -> str:
    hashed = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        hashed.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return hashed.hexdigest()


def loads_whole(folder: Path, files: list[str]) -> bool:
    """Whether every file a resume reads is there and loads in full (not the package's header checks: torch,
    safetensors and json read each one to its end)."""
    try:
        for name in files:
            path = folder / name
            if name.endswith(".json"):
                json.loads(path.read_text())
            elif name.endswith(".safetensors"):
                load_file(str(path))
            else:
                torch.load(path, weights_only=False)
    except Exception:  # noqa: BLE001 (any failure to load is the answer)
        return False
    return True


class Folder:
    """What a checkpoint folder holds: {name: ("whole", digest) | ("incomplete", None) | ("temporary", None)}."""

    def __init__(self, root: Path, pattern: str, files: list[str]):
        self.root, self.pattern, self.files = root, re.compile(pattern), files

    def step(self, name: str) -> int:
        return int(self.pattern.match(name).group(1))

    def snapshot(self) -> dict:
        found = {}
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if not path.is_dir():
                continue
            if self.pattern.match(path.name):
                found[path.name] = ("whole", digest(path)) if loads_whole(path, self.files) else ("incomplete", None)
            else:
                found[path.name] = ("temporary", None)
        return found

    def newest_whole(self, snapshot: dict) -> str | None:
        whole = [n for n, (kind, _) in snapshot.items() if kind == "whole"]
        return max(whole, key=self.step, default=None)


def check_attempt(folder: Folder, before: dict, after: dict, events: list[dict], output: str, keep: int,
                  planted: set, where: str):
    """What must hold across one attempt, killed or not."""
    assert CANNOT_RESUME not in output, where
    removed_by_saves = {Path(e["path"]).name for e in events if e["kind"] in ("shutil.rmtree", "os.rmdir", "os.rename")}
    newest = folder.newest_whole(before)
    for name, (kind, _) in after.items():
        # a kill never leaves part of a checkpoint under a checkpoint's name
        assert kind != "incomplete" or name in planted, f"{where}: {name} is incomplete"
    for name, (kind, content) in before.items():
        if kind == "whole" and name in after:
            assert after[name] == (kind, content), f"{where}: the whole checkpoint {name} changed"
        elif kind == "whole":  # only the rotation deletes one, when `keep` newer whole ones are on disk
            newer = [n for n, (k, _) in after.items() if k == "whole" and folder.step(n) > folder.step(name)]
            assert len(newer) >= keep, f"{where}: the whole checkpoint {name} was deleted, keeping only {newer}"
        elif name not in after:  # an incomplete or temporary folder: deleted only by a save, never by a resume
            assert name in removed_by_saves, f"{where}: {name} disappeared, not in a save"
            assert name not in planted, f"{where}: the incomplete {name} was deleted"
        if name in planted and newest is not None and folder.step(name) > folder.step(newest):
            assert "skipping the incomplete checkpoint" in output and name in output, where


def stopped_attempt(attempts: "Attempts", script: str, argv: list, folder: "Folder", census: dict, stop: tuple,
                    rng: random.Random, attempt: int):
    """Run one attempt stopped at a moment of `stop` drawn by `rng`; check it stopped there as a kill or a full disk
    stops a run. Returns (folder before, folder after, its operations, its output, a description for messages)."""
    save, where, how = stop
    before = folder.snapshot()
    newest = folder.newest_whole(before)
    start = folder.step(newest) if newest else 0
    kill = [*choose_kill(census[start + save], save, where, rng), how]
    status, output, events = attempts.run(script, argv, kill=kill)
    context = f"attempt {attempt}, seed {SEED}, {how} at {killed_where(events)}"
    after = folder.snapshot()
    if how == "kill":
        assert status == -9, f"{context}: not killed (exit {status}):\n{output[-3000:]}"
    else:  # the error names the full disk; the save's temporary folder is gone, the older checkpoints stay
        assert status == 1 and "error: the disk is full" in output, f"{context}:\n{output[-3000:]}"
        assert not [n for n, (k, _) in after.items() if k == "temporary" and step_named(n) == start + save], context
    return before, after, events, output, context


def killed_where(events: list[dict]) -> str:
    hit = next((e for e in events if e["kill"]), None)
    if hit is None:
        return "no kill"
    return f"{hit['kind']} {hit['path']} (save {hit['save']}, {hit['phase']} operation {hit['n']})"


# -------------------------------------------------------------------------------------------------- fine-tuning

TRAINER_FILES = ["trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"]


@pytest.fixture
def finetuning_inputs(tmp_path, tokenizer):
    """A tiny Linformer encoder (with dropout, so the RNG state matters) and 16 labelled rows: 4 steps an epoch."""
    from transformers import AutoModelForMaskedLM

    from hf_linear_attn import LinformerConfig

    torch.manual_seed(0)
    config = LinformerConfig(**{**TINY, "linformer_k": 8, "hidden_dropout_prob": 0.1})
    AutoModelForMaskedLM.from_config(config).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    rows = [{"text": text, "label": i % 2} for i, text in enumerate(CORPUS[:16])]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return tmp_path


@pytest.mark.slow
def test_finetuning_killed_in_saves_again_and_again_ends_as_an_uninterrupted_run(finetuning_inputs, attempts):
    tmp = finetuning_inputs
    keep = 2

    def argv(output_dir):  # 6 steps over 1.5 epochs, a checkpoint every step; one command for every attempt
        return ["--model_name_or_path", tmp / "base", "--train_file", tmp / "train.jsonl", "--text_columns", "text",
                "--label_column", "label", "--do_train", "--output_dir", output_dir, "--max_steps", 6,
                "--save_steps", 1, "--save_total_limit", keep, "--per_device_train_batch_size", 4,
                "--max_seq_length", 32, "--logging_steps", 1, "--report_to", "none", "--seed", 3,
                "--use_cpu", "True", "--resume_from_checkpoint", "True"]

    status, output, census = attempts.run("finetune.py", argv(tmp / "straight"))
    assert status == 0, output[-3000:]
    census = census_by_save(census)  # save number = step

    run = tmp / "killed"
    folder = Folder(run, r"^checkpoint-(\d+)$", TRAINER_FILES)
    rng = random.Random(SEED)
    planted = set()
    for attempt, stop in enumerate(STOPS, start=1):
        before, after, events, output, context = stopped_attempt(attempts, "finetune.py", argv(run), folder, census,
                                                                 stop, rng, attempt)
        newest = folder.newest_whole(before)
        said = "resuming from " + str(run / newest) if newest else "holds no checkpoint yet; training from the start"
        assert said in output, f"{context}: did not resume from the newest whole checkpoint {newest}"
        check_attempt(folder, before, after, events, output, keep, planted, context)
        if attempt == 2:
            # a checkpoint-N damaged some other way (an older version, a file deleted by hand), newer than all
            damaged = run / "checkpoint-9"
            damaged.mkdir()
            (damaged / "trainer_state.json").write_text("{}")
            planted.add(damaged.name)

    before = folder.snapshot()
    status, output, events = attempts.run("finetune.py", argv(run))
    assert status == 0, output[-3000:]
    check_attempt(folder, before, folder.snapshot(), events, output, keep, planted, "the last attempt")
    assert "resuming from " + str(run / folder.newest_whole(before)) in output
    assert (run / "checkpoint-9").is_dir()  # skipped by name and kept
    straight, resumed = weights(tmp / "straight"), weights(run)
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=0, msg=name)
    # the losses logged at every step, those of the killed attempts included (restored with trainer_state.json)
    history = [json.loads((d / "trainer_state.json").read_text())["log_history"] for d in (tmp / "straight", run)]
    losses = [[(h["step"], h["loss"]) for h in log if "loss" in h] for log in history]
    assert losses[0] == losses[1] and len(losses[0]) == 6


# -------------------------------------------------------------------------------------------------- pretraining

ACCELERATE_FILES = ["trainer_state.json", "model.safetensors", "optimizer.bin", "scheduler.bin",
                    "random_states_0.pkl"]


@pytest.mark.slow
@needs_data
def test_pretraining_killed_in_saves_again_and_again_ends_bit_exact(corpus, tmp_path, attempts):
    keep = 2
    config = tiny_preset(tmp_path, "linformer-k32", linformer_k=16)

    def argv(output_dir, *extra):  # masked LM with dropout and dynamic masking, a checkpoint every step
        return pretrain_args(corpus, config, output_dir, "--max_steps", 6, "--save_steps", 1, "--eval_steps", 6,
                             "--save_total_limit", keep, *extra)

    status, output, census = attempts.run("pretrain.py", argv(tmp_path / "straight"))
    assert status == 0, output[-3000:]
    census = census_by_save(census)

    run = tmp_path / "killed"
    folder = Folder(run / "checkpoints", r"^step_(\d+)$", ACCELERATE_FILES)
    rng = random.Random(SEED)
    flags = []  # the first attempt starts the run
    for attempt, stop in enumerate(STOPS, start=1):
        before, after, events, output, context = stopped_attempt(attempts, "pretrain.py", argv(run, *flags), folder,
                                                                 census, stop, rng, attempt)
        newest = folder.newest_whole(before)
        if newest:
            assert f"resumed from {run / 'checkpoints' / newest}" in output, context
        elif flags:  # killed before its first checkpoint was whole: the same --resume starts the run again
            assert "no checkpoint yet; --resume starts it from step 0" in output, context
        # a run started again replaces its folder (temporary folders of the killed saves go with it)
        check_attempt(folder, {} if flags and not newest else before, after, events, output, keep, set(), context)
        flags = ["--resume"]  # one command for every retry, as with fine-tuning's --resume_from_checkpoint True

    before = folder.snapshot()
    status, output, events = attempts.run("pretrain.py", argv(run, "--resume"))
    assert status == 0, output[-3000:]
    check_attempt(folder, before, folder.snapshot(), events, output, keep, set(), "the last attempt")
    straight, resumed = weights(tmp_path / "straight"), weights(run)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    results = [json.loads((d / "train_results.json").read_text()) for d in (tmp_path / "straight", run)]
    assert results[0]["eval_loss"] == results[1]["eval_loss"]
