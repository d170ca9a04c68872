"""Training-step speed and peak memory of one (model, length), each in a fresh process (LRA Table 2's shape).

`python -m experiments.long_range.efficiency --one SPEC` builds the model, runs AdamW training steps on random
full-length byte inputs, and prints JSON: the median step time after a warm-up step (via
`benchmarks.measuring.measured`) and the peak memory of one more step above what was in use before it
(`measuring.PeakMemory`: the resident-set high-water mark on CPU, `max_memory_allocated` on CUDA), so weights and
optimizer state are not counted, activations and gradients are. Before and after the steps it times a fixed float32
matmul (`probe_gflops`): on a machine shared with other jobs that product slows down with them, so the runner can
tell a disturbed measurement from a slow model (`contended`).
"""

import argparse
import json
import time

import torch

from benchmarks.measuring import matmul_peak, measured, run_isolated

from .models import Dims, build_encoder

# The availability probe: a float32 matmul of this size takes about 10-20 ms on 2 CPU cores, long enough to be timed
# steadily and short enough to run twice per measurement. Why not CPU seconds per wall second: OpenMP threads spin
# while they wait, so a process on shared cores still reads about 2 CPU seconds per second (the earlier check, which
# never fired while other jobs halved the speed).
PROBE_SIZE = 1024
CONTENDED_BELOW = 0.75  # a probe under 75% of the best on record: other jobs held the cores (quiet probes vary
# by up to 18% on the 2-core EPYC, 152-186 GFLOP/s over 48 quiet measurements; beside a training job, under half)


def availability_probe(device: str) -> float:
    """GFLOP/s of a fixed float32 matmul now (median of 7): the share of the machine this process gets."""
    return matmul_peak(torch.float32, device, size=PROBE_SIZE, repeats=7)


def probe_of(result: dict) -> float | None:
    """The lower of a measurement's two probes (None for a record made before the probe existed)."""
    probes = result.get("probe_gflops")
    return min(probes) if probes else None


def best_probe(records: dict) -> float:
    """The highest probe among the efficiency records (0.0 when none has one): the unshared machine's figure."""
    return max((probe_of(r["metrics"]) or 0.0 for r in records.values() if r["kind"] == "efficiency"), default=0.0)


def contended(result: dict, best_probe: float) -> bool:
    """True when the machine was visibly shared during the measurement: a probe under CONTENDED_BELOW of the best
    probe on record, or no probe at all (unchecked). Failures (out of memory, a timeout) are findings, never
    contended."""
    if "failed" in result:
        return False
    probe = probe_of(result)
    return probe is None or probe < CONTENDED_BELOW * best_probe


def measurement_spec(stage_args: dict) -> dict:
    """What the measuring process takes from an efficiency stage's arguments: all but the runner's own timeout and
    retries."""
    return {k: v for k, v in stage_args.items() if k not in ("timeout", "retries")}


def training_step(spec: dict):
    """(model, step, device): one AdamW training step of the spec's model on random full-length byte inputs."""
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

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()

    return model, step, device


def measure_training_step(spec: dict) -> dict:
    """Measure one (model, n) in this process."""
    model, train_step, device = training_step(spec)
    cpu_seconds, wall_seconds = [], []
    probe_before = availability_probe(device)

    def step():
        start, wall = time.process_time(), time.perf_counter()
        train_step()
        cpu_seconds.append(time.process_time() - start)
        wall_seconds.append(time.perf_counter() - wall)

    seconds, memory = measured(step, spec["repeats"], device, spec.get("budget"))
    result = {"seconds_per_step": seconds, "steps_per_second": 1 / seconds, "device": device,
              "probe_gflops": [probe_before, availability_probe(device)]}
    if device == "cpu":
        # On a CPU shared with other jobs the median wall time varies several times with their load; the fastest of
        # the calls after the warm-up is the usual robust estimate of an unshared step (the tables use it). The
        # process's CPU time is recorded too (it counts OpenMP spin-waiting, so it is no measure of sharing).
        after_warmup = wall_seconds[1:] or wall_seconds
        result["best_seconds_per_step"] = min(after_warmup)
        result["best_steps_per_second"] = 1 / result["best_seconds_per_step"]
        result["cpu_seconds_per_step"] = sorted(cpu_seconds[1:] or cpu_seconds)[len(cpu_seconds[1:] or cpu_seconds) // 2]
        result["threads"] = torch.get_num_threads()
    if isinstance(memory, dict):  # measuring.measured: {"bytes", "profiler_bytes"}, or the probes' disagreement
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


def profile_training_step(spec: dict, steps: int = 3, rows: int = 15) -> str:
    """torch.profiler's table of the operators taking the most self time over `steps` training steps (after one
    warm-up step), with each operator's share of the total: where a model's step time goes."""
    _, step, _ = training_step(spec)
    step()
    with torch.profiler.profile() as profile:
        for _ in range(steps):
            step()
    return profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def memory_bytes(result: dict) -> int | None:
    """The memory figure the tables use: the profiler's tensor peak where measured (the resident-set probe misreads
    on CPU when the allocator reuses pages), else the resident-set peak."""
    return result.get("profiler_bytes", result.get("peak_bytes"))


def measure_isolated(spec: dict, timeout: float) -> dict:
    """measure_training_step in a fresh process; a kill, an error or a timeout becomes {"failed": reason}."""
    return run_isolated("experiments.long_range.efficiency", spec, timeout, reason_chars=300)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", required=True)
    print(json.dumps(measure_training_step(json.loads(parser.parse_args().one))))
