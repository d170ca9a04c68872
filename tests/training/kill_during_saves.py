"""Training-script processes that SIGKILL themselves at a chosen file operation of a checkpoint save (used by
tests/training/test_kill_loop.py; run as `python kill_during_saves.py`, it serves requests on stdin).

One parent process imports torch, transformers, accelerate and the package once, then forks a child per attempt:
the child runs scripts/<script> as __main__ with the attempt's arguments. It holds no training state (only the
imports are shared, and no torch operation has run in the parent), so it starts as a fresh process would, without
the seconds of imports each fresh process pays. Requests and answers are JSON lines:
  -> {"script": "finetune.py", "argv": [...], "kill": [save, phase, n, how] or null, "log": PATH, "output": PATH}
  <- {"status": exit code, or -9 for a SIGKILL}

What counts as an event: every file operation made while a checkpoint is being saved (inside
pretraining.save_checkpoint or AtomicCheckpointTrainer._save_checkpoint): a file opened for writing, a folder made,
a rename, a removal (Python's audit hooks see these before they happen), and each torch.save and safetensors
save_file, which open their files in C++ / Rust and are wrapped here. Its phase says whose code made it: "library"
inside Trainer._save_checkpoint or Accelerator.save_state, "script" in the package's own code around them (the
temporary folder, the rename into place, the rotation of old checkpoints). Every event is logged to "log" as a
JSON line; at the event "kill" names (the n-th event of that phase in the attempt's save number `save`, from 1) the
child logs it and, with how = "kill", sends itself SIGKILL: before a rename, removal or open, and half-way through a
torch / safetensors file (its first half is written, as when a kill lands during the write). With how = "full" the
disk is full there instead: that operation fails with ENOSPC (a file after its first half), and the script carries on
as it would.
"""

import errno
import io
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
AUDITED = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "shutil.move",
           "shutil.copyfile"}


class SaveKiller:
    """Counts the file operations of checkpoint saves and kills this process at the chosen one."""

    def __init__(self, kill, log_path: str):
        self.kill = tuple(kill[:3]) if kill else None
        self.how = kill[3] if kill else None
        self.log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.saves = 0  # outer saves begun in this process
        self.phase = None  # None outside a save, else "script" or "library"
        self.counts = {}
        self.busy = False  # set while this class writes, so its own operations are not events

    def event(self, kind: str, path) -> bool:
        """Log one operation; True when it is the one to die at (the caller then dies its own way)."""
        if self.phase is None or self.busy:
            return False
        self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        chosen = self.kill == (self.saves, self.phase, self.counts[self.phase])
        record = {"save": self.saves, "phase": self.phase, "n": self.counts[self.phase], "kind": kind,
                  "path": os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path),
                  "kill": chosen}
        os.write(self.log, (json.dumps(record) + "\n").encode())  # a syscall: on disk for the test after the kill
        return chosen

    def die(self, path):
        if self.how == "full":
            self.busy = False
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        os.kill(os.getpid(), signal.SIGKILL)

    def audit(self, name, args):
        if name not in AUDITED or self.phase is None or self.busy:
            return
        if name == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE_FLAGS)
            if not writes:
                return
        else:
            path = args[0]
        if self.event(name, path):
            self.die(path)  # audit hooks run before the operation: it never happens (an exception aborts it)

    def wrap_writer(self, real, serialize, kind):
        """torch.save / safetensors save_file: an event; at the kill, half of the file's bytes, then SIGKILL."""
        def writer(obj, target, *args, **kwargs):
            if self.event(kind, target):
                if isinstance(target, (str, os.PathLike)):  # (a file object: die before writing)
                    data = serialize(obj, *args, **kwargs)
                    self.busy = True
                    with open(target, "wb") as handle:
                        handle.write(data[: len(data) // 2])
                        handle.flush()
                self.die(target)
            return real(obj, target, *args, **kwargs)
        return writer

    def wrap_phase(self, real, phase, outer=False):
        """A function during which events belong to `phase` (`outer`: a whole checkpoint save, counted)."""
        killer = self

        def during(*args, **kwargs):
            before = killer.phase
            if outer:
                killer.saves += 1
                killer.counts = {}
            killer.phase = phase
            try:
                return real(*args, **kwargs)
            finally:
                killer.phase = before
        return during

    def install(self):
        import safetensors.torch
        import torch
        from accelerate import Accelerator
        from transformers import Trainer

        from hf_linear_attn.training import finetuning, pretraining

        def torch_bytes(obj, *args, **kwargs):
            buffer = io.BytesIO()
            real_torch_save(obj, buffer, *args, **kwargs)
            return buffer.getvalue()

        real_torch_save = torch.save
        torch.save = self.wrap_writer(torch.save, torch_bytes, "torch.save")
        # transformers and accelerate bound save_file at their import: wrap it where they call it
        real_save_file = safetensors.torch.save_file
        wrapped = self.wrap_writer(real_save_file, lambda tensors, metadata=None: safetensors.torch.save(
            tensors, metadata=metadata), "safetensors")
        for module in list(sys.modules.values()):
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is real_save_file:
                    setattr(module, name, wrapped)
        Trainer._save_checkpoint = self.wrap_phase(Trainer._save_checkpoint, "library")
        Accelerator.save_state = self.wrap_phase(Accelerator.save_state, "library")
        trainer_class = finetuning.AtomicCheckpointTrainer
        trainer_class._save_checkpoint = self.wrap_phase(trainer_class._save_checkpoint, "script", outer=True)
        pretraining.save_checkpoint = self.wrap_phase(pretraining.save_checkpoint, "script", outer=True)
        sys.addaudithook(self.audit)


def run_child(request: dict) -> int:
    """In the forked child: output to the request's file, the killer armed, the script run as __main__."""
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    SaveKiller(request["kill"], request["log"]).install()
    script = str(REPO_ROOT / "scripts" / request["script"])
    sys.argv = [script, *request["argv"]]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:  # the scripts stop with sys.exit("error: ...")
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 (any crash is an answer for the test)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve():
    sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]
    # everything an attempt imports, once, before any fork (no torch operation runs here, so no thread pool
    # exists for a child to inherit half-started)
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import evaluate  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import hf_linear_attn.training.finetuning
    import hf_linear_attn.training.pretraining  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_child(request)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
