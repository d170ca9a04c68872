"""Training-step speed and peak memory of one (model, length), each in a fresh process (LRA Table 2's shape).

`python -m hf_linear_attn.experiments.long_range.efficiency --one SPEC` builds the model, runs AdamW training steps
on random full-length byte inputs, and prints JSON: the median step time after a warm-up step (via
`benchmarks.measured`) and the peak memory of one more step above what was in use before it (`benchmarks.PeakMemory`:
the resident-set high-water mark on CPU, `max_memory_allocated` on CUDA), so weights and optimizer state are not
counted, activations and gradients are.
"""

import argparse
import json
import subprocess
import sys
import time

import torch

from hf_linear_attn.experiments.benchmarks import measured

from .models import Dims, build_encoder


def measure_training_step(spec: dict) -> dict:
    """Measure one (model, n) in this process."""
    torch.manual_seed(spec.get("seed", 0))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = Dims(**spec["dims"])
    n, batch = spec["n"], spec["batch_size"]
    model = build_encoder(spec["model"], dims, n, spec["vocab_size"], 2, dropout=spec.get("dropout", 0.1)).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, spec["vocab_size"], (batch, n), device=device)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (batch,), device=device)

    cpu_seconds, wall_seconds = [], []

    def step():
        start, wall = time.process_time(), time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        cpu_seconds.append(time.process_time() - start)
        wall_seconds.append(time.perf_counter() - wall)

    seconds, memory = measured(step, spec["repeats"], device, spec.get("budget"))
    result = {"seconds_per_step": seconds, "steps_per_second": 1 / seconds, "device": device}
    if device == "cpu":
        # On a CPU shared with other jobs the median wall time varies several times with their load; the fastest of
        # the calls after the warm-up is the usual robust estimate of an unshared step (the tables use it). The
        # process's CPU time is recorded too (it counts OpenMP spin-waiting, so it is no clean measure either).
        after_warmup = wall_seconds[1:] or wall_seconds
        result["best_seconds_per_step"] = min(after_warmup)
        result["best_steps_per_second"] = 1 / result["best_seconds_per_step"]
        result["cpu_seconds_per_step"] = sorted(cpu_seconds[1:] or cpu_seconds)[len(cpu_seconds[1:] or cpu_seconds) // 2]
        result["threads"] = torch.get_num_threads()
    if isinstance(memory, dict):  # benchmarks.measured: {"bytes", "profiler_bytes"}, or the probes' disagreement
        result["peak_bytes"] = memory.get("bytes", memory.get("resident_bytes"))
        if memory.get("profiler_bytes") is not None:
            result["profiler_bytes"] = memory["profiler_bytes"]
        if "failed" in memory:
            result["memory_note"] = memory["failed"]
    else:
        result["peak_bytes"] = memory
    if spec["model"] == "bigbird":
        result["bigbird_attention"] = model.bert.attention_type
    return result


def memory_bytes(result: dict) -> int | None:
    """The memory figure the tables use: the profiler's tensor peak where measured (the resident-set probe misreads
    on CPU when the allocator reuses pages), else the resident-set peak."""
    return result.get("profiler_bytes", result.get("peak_bytes"))


def run_isolated(spec: dict, timeout: float) -> dict:
    """measure_training_step in a fresh process; a kill, an error or a timeout becomes {"failed": reason}."""
    try:
        proc = subprocess.run([sys.executable, "-m", "hf_linear_attn.experiments.long_range.efficiency", "--one",
                               json.dumps(spec)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"over {timeout:.0f} s"}
    if proc.returncode != 0:
        killed = proc.returncode in (-9, 137)
        reason = "out of memory (killed)" if killed else (proc.stderr.strip().splitlines() or ["error"])[-1]
        return {"failed": reason[:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", required=True)
    print(json.dumps(measure_training_step(json.loads(parser.parse_args().one))))
