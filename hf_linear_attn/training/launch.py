"""`accelerate launch --num_processes N script.py` on a machine without GPUs.

accelerate (1.x) starts such a command with its simple launcher: one process, no warning, `--num_processes`
dropped (its multi-process launcher is chosen only by `--multi_gpu`, a config file, or more than one GPU found; on
CPU `--multi_gpu` runs N processes on gloo). The child cannot see N in its environment, so the scripts read the
launcher's own command line (its parent process) and, on a CPU-only machine, start the same command again with
`--multi_gpu` (every other launcher flag kept); with GPUs present they refuse, naming the command that works.

Trainer then needs telling that the processes run on CPUs (`use_cpu_for_several_processes`).
"""

import os
import shlex
import sys
from pathlib import Path

from .errors import UsageError

RELAUNCHED = "HF_LINEAR_ATTN_RELAUNCHED"


def _parent_command_line() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:  # not Linux, or the parent is gone
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def single_process_launch(script: str, parent: list[str] | None = None, environ=None) -> tuple[list[str], int] | None:
    """(launcher command, N) when this process was started alone by `accelerate launch --num_processes N` (N > 1)
    through accelerate's simple launcher; None otherwise (plain python, torchrun, --multi_gpu, N = 1)."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" in environ or "ACCELERATE_USE_CPU" not in environ:  # torchrun / multi-process, or no accelerate
        return None
    parent = _parent_command_line() if parent is None else parent
    launch = next((i for i, part in enumerate(parent) if part == "launch" or part.endswith("accelerate.commands.launch")), None)
    if launch is None:
        return None
    here = Path(script).resolve()
    end = next((i for i in range(launch + 1, len(parent)) if Path(parent[i]).resolve() == here), None)
    if end is None:
        return None
    flags = parent[launch + 1:end]
    count = None
    for i, flag in enumerate(flags):
        if flag in ("--num_processes", "--num-processes") and i + 1 < len(flags):
            count = flags[i + 1]
        elif flag.startswith(("--num_processes=", "--num-processes=")):
            count = flag.split("=", 1)[1]
    if count is None or not count.isdigit() or int(count) < 2:
        return None
    return parent, int(count)


def ensure_requested_processes(script: str) -> None:
    """Under `accelerate launch --num_processes N` (N > 1) that started one process: on a CPU-only machine, replace
    this process by the same launch with --multi_gpu (N processes on gloo); with GPUs, refuse naming the command."""
    found = single_process_launch(script)
    if found is None:
        return
    parent, count = found
    launch = next(i for i, part in enumerate(parent) if part == "launch" or part.endswith("accelerate.commands.launch"))
    working = [*parent[: launch + 1], "--multi_gpu", *parent[launch + 1:]]
    import torch

    if os.environ.get(RELAUNCHED) or torch.cuda.is_available():
        raise UsageError(f"accelerate launch --num_processes {count} started one process, not {count} (its simple "
                         f"launcher drops --num_processes unless --multi_gpu is given); run:\n  {shlex.join(working)}")
    print(f"accelerate launch --num_processes {count} started one process on this machine without GPUs; starting "
          f"{count} processes (gloo) with: {shlex.join(working)}", file=sys.stderr, flush=True)
    os.environ[RELAUNCHED] = "1"
    os.execvp(working[0], working)


def without_gpus() -> bool:
    """Whether this machine has no device that accelerate runs on instead of the CPU (CUDA, XPU)."""
    import torch  # here, not at the top: the scripts import this module before they parse their arguments

    return not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))


def use_cpu_for_several_processes(environ=None) -> bool:
    """Under a multi-process launch (torchrun, `accelerate launch --multi_gpu` or an FSDP config) on a machine
    without GPUs, set ACCELERATE_USE_CPU, which TrainingArguments reads as --use_cpu. Without it Trainer finds no
    device to run several processes on and sets up each process alone (DistributedType.NO): N independent runs,
    each on all the data and writing the same output folder, with only a logged warning ("torch.distributed
    process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED"). Returns whether it set it."""
    environ = os.environ if environ is None else environ
    if int(environ.get("WORLD_SIZE", "1")) < 2 or environ.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1"):
        return False
    if not without_gpus():
        return False
    environ["ACCELERATE_USE_CPU"] = "true"
    return True
