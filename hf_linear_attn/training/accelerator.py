"""The Accelerator of a pretraining run: mixed precision ('auto' from the hardware), trackers, and FSDP where the
launcher asks for it (on CPUs through `fsdp.use_fsdp_on_cpu`)."""

from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, LoggerType

from .errors import UsageError
from .fsdp import fsdp_requested, use_fsdp_on_cpu
from .launch import without_gpus
from .pretraining_arguments import PretrainArguments

CPUINFO = Path("/proc/cpuinfo")  # where "auto" precision reads the CPU's instruction-set flags


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
    on_cpu = without_gpus()
    check_accelerator_arguments(args, on_cpu)
    mixed_precision = resolve_mixed_precision(args.mixed_precision)
    release_stale_accelerator_state(mixed_precision)
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=mixed_precision,
                              log_with=None if args.report_to == "none" else args.report_to,
                              project_dir=args.output_dir)
    if on_cpu and fsdp_requested() and accelerator.distributed_type == DistributedType.MULTI_CPU:
        use_fsdp_on_cpu(accelerator)
    return accelerator
