"""What every benchmark and experiment measures with: time, memory, the machine's matmul peak, the machine itself,
and one configuration in a fresh process.

The suites (suites.py, decoding.py, kernel_crossover.py) and the experiments' measurements (experiments/long_range)
import this module and nothing of each other's, so no suite reaches back into another. Times are medians over
repeated calls after a warm-up call. Memory is measured on one more call: on CPU the process's peak resident set
(VmHWM, reset through /proc/self/clear_refs) minus its resident set before the call, with glibc told to return freed
blocks at once (see `release_freed_memory_at_once`), checked against torch.profiler's tensor peak; on CUDA
`torch.cuda.max_memory_allocated` minus the memory allocated before it.
"""

import ctypes
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

CHECKOUT = Path(__file__).resolve().parents[1]  # the folder holding benchmarks/, experiments/ and scripts/
CPUINFO = Path("/proc/cpuinfo")
# The instruction sets that decide CPU speed here: AVX2 only, bf16 products emulated (a bf16 matmul takes thousands
# of times float32's); AVX-512; native bf16 products (AVX512-BF16, AMX). Two machines sold as the same "AMD EPYC,
# 2 cores" differ exactly there, so every results file names them.
INSTRUCTION_SETS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


# ------------------------------------------------------------------------------------------------------ the machine


def describe_machine() -> str:
    """CPU model, cores, torch build; the GPU when there is one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}"
    return text


def instruction_sets(cpuinfo: str | None = None) -> list[str]:
    """Which of INSTRUCTION_SETS the CPU has, from the flags lines of `cpuinfo` (/proc/cpuinfo's text, read if None);
    [] where there is no /proc/cpuinfo (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return [name for name in INSTRUCTION_SETS if name in flags]


def describe_hardware(device: str | None = None) -> dict:
    """What a results file records beside `describe_machine()`'s line: the CPU's instruction sets, cores, torch
    version, and the float32 and bfloat16 matmul peaks (GFLOP/s, `matmul_peak`), measured once per process (a
    runner asks for it once per stage), so that a figure can be read against the machine that made it."""
    return dict(_hardware(device or ("cuda" if torch.cuda.is_available() else "cpu")))


@functools.lru_cache(maxsize=None)
def _hardware(device: str) -> dict:
    return {"instruction_sets": instruction_sets(), "cores": os.cpu_count(), "torch": torch.__version__,
            "matmul_peak_gflops": {name: round(matmul_peak(getattr(torch, name), device), 1)
                                   for name in ("float32", "bfloat16")}}


def hardware_text(hardware: dict | None) -> str:
    """The hardware record as a report says it ("" for a report made before it was recorded, which then renders
    as it did): 'instruction sets avx2 avx512f; matmul peak 152.0 GFLOP/s float32, 0.4 GFLOP/s bfloat16'."""
    if not hardware:
        return ""
    peaks = ", ".join(f"{value:,.1f} GFLOP/s {name}" for name, value in hardware["matmul_peak_gflops"].items())
    return f"{_sets_text(hardware)}; matmul peak {peaks}"


def _sets_text(hardware: dict) -> str:
    return "instruction sets " + (" ".join(hardware["instruction_sets"]) or "none of " + " ".join(INSTRUCTION_SETS))


def hardware_of_records(records) -> list[str]:
    """The hardware of a run's stage records, one text per distinct set of instruction sets, in the order first met
    ([] where no record has one: a run made before they were recorded, whose report then renders as it did). Each
    stage measures the matmul peak at its start, so stages on one machine differ a little: where they do, the peak is
    given as the range over those stages ('matmul peak 126.3-155.1 GFLOP/s float32, ... (measured at each of 3
    stages' start)')."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("hardware"):
            groups.setdefault(tuple(r["hardware"]["instruction_sets"]), []).append(r["hardware"])
    texts = []
    for group in groups.values():
        peaks = {name: sorted(h["matmul_peak_gflops"][name] for h in group) for name in group[0]["matmul_peak_gflops"]}
        if all(values[0] == values[-1] for values in peaks.values()):
            texts.append(hardware_text(group[0]))
            continue
        ranges = ", ".join(f"{v[0]:,.1f}-{v[-1]:,.1f} GFLOP/s {name}" for name, v in peaks.items())
        texts.append(f"{_sets_text(group[0])}; matmul peak {ranges} (measured at each of {len(group)} stages' start)")
    return texts


# ------------------------------------------------------------------------------------------------- measuring


def rss_bytes(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS: the resident set now; VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Peak memory of the calls inside the block, above what was in use when it started (bytes)."""

    def __init__(self, device: str):
        self.device, self.extra = device, 0

    def __enter__(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set, to VmRSS now
            self.start = rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.start
        else:
            self.extra = rss_bytes("VmHWM") - self.start


def release_freed_memory_at_once(device: str) -> None:
    """From now on, let every freed block over 64 kB leave the resident set (CPU, glibc), so VmHWM sees true peaks.

    glibc keeps freed blocks below its adaptive mmap threshold (up to 32 MB) in the heap; a later call reuses them
    without raising the peak resident set, so a measurement after a warm-up would miss most of a model's
    activations. It also makes allocation slower, which is why it is called only after the timed calls.
    """
    if device != "cpu":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing retained this way that we know of
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.malloc_trim(0)


def profiler_peak_bytes(fn) -> int:
    """Peak of the bytes held by tensors allocated during fn(), from torch.profiler(profile_memory=True): the running
    sum of every event's own allocations and frees, in time order (an independent probe of the resident-set one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak


# Below this, a CPU memory figure is within the resident-set probe's noise (page-level reuse by the allocator):
# the tables show it, but compute no ratio from it.
MEMORY_FLOOR = 4 * 2**20


# The two memory probes must agree within these margins, or the row's memory is marked failed: the resident set can
# exceed the tensors' peak (allocator slack, library scratch) by up to 3x + 64 MB, and fall short of it by at most
# half of it plus MEMORY_FLOOR (allocations under glibc's mmap threshold reuse heap pages).
PROBE_MARGINS = dict(low=0.5, high=3.0, slack=64 * 2**20)


def probes_disagree(resident: int, tensors: int) -> str | None:
    """Why the resident-set and the profiler probe cannot both be right, or None when they agree within PROBE_MARGINS."""
    if resident < PROBE_MARGINS["low"] * tensors - MEMORY_FLOOR or resident > (
        PROBE_MARGINS["high"] * tensors + PROBE_MARGINS["slack"]
    ):
        return f"memory probes disagree: resident set {mb(resident)} MB, tensors {mb(tensors)} MB"
    return None


def measured(fn, repeats: int, device: str, budget: float | None = None) -> tuple[float, dict]:
    """(median seconds of fn over `repeats` calls after a warm-up call, memory of one more call).

    Time first, with the allocator as users have it; memory last, of a single call after the warm-up (one-time
    library caches are not activations) and after one more call under the new allocator settings. On CPU the memory
    is read by two probes (resident set, profiler); the dict is {"bytes", "profiler_bytes"} when they agree, else
    {"failed": why, ...}: a figure that one probe contradicts is never reported as a measurement.
    """
    seconds = median_seconds(fn, repeats, device, budget)
    release_freed_memory_at_once(device)
    fn()  # settles the heap after the trim: its pages fault back in here, not inside the measurement
    with PeakMemory(device) as memory:
        fn()
    if device != "cpu":
        return seconds, {"bytes": memory.extra}
    tensors = profiler_peak_bytes(fn)
    reason = probes_disagree(memory.extra, tensors)
    if reason:
        return seconds, {"failed": reason, "resident_bytes": memory.extra, "profiler_bytes": tensors}
    return seconds, {"bytes": memory.extra, "profiler_bytes": tensors}


def median_seconds(fn, repeats: int, device: str, budget: float | None = None) -> float:
    """Median wall time of fn() over `repeats` calls after one warm-up call (fewer, at least one, when the calls
    would take more than `budget` seconds in all: the longest configurations take minutes per call)."""
    start = time.perf_counter()
    fn()
    if budget is not None:
        repeats = max(1, min(repeats, int(budget / (time.perf_counter() - start))))
    return statistics.median(timed_call(fn, device) for _ in range(repeats))


def timed_call(fn, device: str) -> float:
    """Wall seconds of one fn() call (on CUDA, from an idle device to the end of its work)."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def matmul_peak(dtype: torch.dtype, device: str, size: int = 2048, repeats: int = 5) -> float:
    """Measured GFLOP/s of a square matmul: the machine's practical peak for this dtype (a 256 product where bf16 is
    emulated: one 2048 product there takes minutes)."""
    from hf_linear_attn.linear_attention import native_bf16

    if dtype == torch.bfloat16 and not native_bf16(device):
        size = 256
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / median_seconds(lambda: a @ b, repeats, device) / 1e9


# --------------------------------------------------------------------------------------------- models, tables


def decoder_model(spec: dict, device: str, n_positions: int):
    """A causal LM of spec["model"] (gpt2 with SDPA, or one of ours) at spec["dims"], float32, on device; without
    dropout where spec["dropout"] is False; the causal Linformer with spec["k"] and spec["block"]; spec["config"]:
    further config fields (a linear decoder's window or decay)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_linear_attn  # noqa: F401

    extra = {"linformer_k": spec["k"], "linformer_block_size": spec["block"]} if spec["model"] == "linformer_gpt2" else {}
    dropout = {} if spec.get("dropout", True) else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = AutoConfig.for_model(spec["model"], vocab_size=spec["vocab_size"], n_positions=n_positions,
                                  **dropout, **spec["dims"], **extra, **spec.get("config", {}))
    kwargs = {"attn_implementation": "sdpa"} if spec["model"] == "gpt2" else {}
    return AutoModelForCausalLM.from_config(config, **kwargs).to(device)


def cache_bytes(cache) -> int:
    """Bytes a generation cache holds: our state's own count, or every key and value tensor of a DynamicCache."""
    if hasattr(cache, "state_bytes"):
        return cache.state_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def failure(result: dict, key: str) -> str:
    """What a table cell shows for a missing figure: the run's failure, the memory probes' disagreement, or "-"."""
    return result.get("failed") or result.get(f"{key}_failed") or result.get("skipped") or "-"


def mb(value) -> str:
    """Bytes as MB (2**20) with one decimal, as the tables print them."""
    return f"{value / 2**20:,.1f}"


# ---------------------------------------------------------------------------------------- processes, files


# The modules every measuring process imports (about 6 s on 2 cores). A server process imports them once, then forks
# one child per configuration: each child is as fresh as a new process for what it measures (its own memory peak,
# its own kill), without the imports. `python -m benchmarks.measuring --serve` is that server.
PRELOAD = ("torch", "transformers", "hf_linear_attn", "benchmarks.measuring")
_server = None  # the running server (subprocess.Popen), started by the first run_isolated


def _run_as_main(module: str, spec_json: str, stdout: str, stderr: str, environ: dict, cwd: str) -> None:
    """In a forked child: `python -m module --one SPEC` in the caller's folder and environment, its output in files."""
    import runpy

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    # the caller's PYTHONPATH now (the server's sys.path is from its start), ahead as `python -m` would put it
    paths = environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.path[:0] = [entry for entry in paths if entry and entry not in sys.path]
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [module, "--one", spec_json]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def serve() -> None:
    """The server: import PRELOAD, then for each job line on stdin fork a child that runs it; answer the child's pid
    at once (so the caller can kill it at its timeout) and its exit code when it ends (negative: killed by signal)."""
    import importlib
    import traceback

    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _run_as_main(**job)
                code = 0
            except SystemExit as stop:  # argparse's errors and sys.exit, as `python -m` would exit
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, int) and stop.code is not None:
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps({"exitcode": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)


def _running_server():
    """The server, started on first use (and again if it died). Its imports see this checkout from any folder."""
    global _server
    if _server is None or _server.poll() is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))}
        # unbuffered pipes: select() below must see every byte the server wrote, none held in a reader's buffer
        _server = subprocess.Popen([sys.executable, "-m", "benchmarks.measuring", "--serve"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
    return _server


def _answer(server) -> dict:
    line = server.stdout.readline()
    if not line:
        raise RuntimeError("the measuring server ended")
    return json.loads(line)


def _failure_reason(returncode: int, stderr: str, reason_chars: int) -> dict:
    killed = returncode in (-9, 137)
    reason = "out of memory (killed)" if killed else (stderr.strip().splitlines() or ["error"])[-1]
    return {"failed": reason[:reason_chars]}


def _run_in_new_interpreter(module: str, spec: dict, timeout: float, reason_chars: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-m", module, "--one", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"over {timeout:.0f} s"}
    if proc.returncode != 0:
        return _failure_reason(proc.returncode, proc.stderr, reason_chars)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_isolated(module: str, spec: dict, timeout: float, reason_chars: int = 200) -> dict:
    """`python -m module --one SPEC` in a fresh process, its last stdout line read as JSON; an out-of-memory kill, an
    error or a timeout becomes {"failed": reason} (the reason cut to `reason_chars`). On CPU the process is a child
    forked from a server that has imported PRELOAD (see `serve`), in this process's folder and environment; where
    CUDA is available, a new interpreter (what the server holds would not survive the fork there)."""
    import select
    import signal
    import tempfile

    if torch.cuda.is_available():  # a CUDA context does not survive a fork: a new interpreter per configuration
        return _run_in_new_interpreter(module, spec, timeout, reason_chars)
    with tempfile.TemporaryDirectory(prefix="measure-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        server = _running_server()
        job = dict(module=module, spec_json=json.dumps(spec), stdout=str(out), stderr=str(err),
                   environ=dict(os.environ), cwd=os.getcwd())
        try:
            server.stdin.write((json.dumps(job) + "\n").encode())
            pid = _answer(server)["pid"]
            timed_out = not select.select([server.stdout], [], [], timeout)[0]
            if timed_out:
                os.kill(pid, signal.SIGKILL)
            exitcode = _answer(server)["exitcode"]
        except (OSError, RuntimeError) as error:  # the server itself was killed (out of memory, say)
            return {"failed": f"measuring server: {error}"[:reason_chars]}
        if timed_out:
            return {"failed": f"over {timeout:.0f} s"}
        if exitcode != 0:
            return _failure_reason(exitcode, err.read_text(errors="replace") if err.is_file() else "", reason_chars)
        return json.loads(out.read_text().strip().splitlines()[-1])


def write_json(path: Path, value) -> None:
    """Whole or not at all: a kill mid-write leaves the previous file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2))
    os.replace(partial, path)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
