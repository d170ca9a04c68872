"""The shared measuring module's machine record: instruction sets read from cpuinfo's flags lines, and reports that
say them where they were recorded and render exactly as before where they were not; configurations measured in
fresh processes (forked from a server that has done the imports)."""

import json
import os
import shutil

import pytest
from helpers import REPO_ROOT

from benchmarks import measuring, suites
from benchmarks.measuring import (
    INSTRUCTION_SETS, describe_hardware, hardware_of_records, hardware_text, instruction_sets,
)


def cpuinfo(flags: str, bugs: str = "") -> str:
    # two logical CPUs, as /proc/cpuinfo lists them; "bugs" lines mention flag-like words that are not flags
    block = f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse {flags}\nbugs\t\t: {bugs}\n\n"
    return block + block.replace("processor\t: 0", "processor\t: 1")


@pytest.mark.parametrize("flags, expected", [
    ("avx avx2 fma", ["avx2"]),  # the AVX2-only EPYC of the committed runs
    ("avx2 avx512f avx512bw avx512_bf16", ["avx2", "avx512f", "avx512_bf16"]),
    ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]),
    ("sse4_2", []),
])
def test_instruction_sets_are_read_from_the_flags_lines_only(flags, expected):
    assert instruction_sets(cpuinfo(flags, bugs="avx512f_emulated amx_bf16")) == expected


def test_the_hardware_record_names_sets_cores_torch_and_both_peaks_and_renders_in_one_line():
    record = describe_hardware("cpu")
    assert set(record) == {"instruction_sets", "cores", "torch", "matmul_peak_gflops"}
    assert set(record["instruction_sets"]) <= set(INSTRUCTION_SETS) and record["cores"] >= 1
    assert set(record["matmul_peak_gflops"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in record["matmul_peak_gflops"].values())
    known = {"instruction_sets": ["avx2"], "cores": 2, "torch": "2.13.0+cpu",
             "matmul_peak_gflops": {"float32": 152.04, "bfloat16": 0.4}}
    assert hardware_text(known) == ("instruction sets avx2; matmul peak 152.0 GFLOP/s float32, "
                                    "0.4 GFLOP/s bfloat16")
    assert hardware_text(None) == "" and hardware_text({**known, "instruction_sets": []}).startswith(
        "instruction sets none of avx2 avx512f")
    assert hardware_of_records([{"hardware": known}, {}, {"hardware": known}]) == [hardware_text(known)]
    assert hardware_of_records([{"machine": "AMD EPYC"}]) == []
    # stages on one machine measure slightly different peaks: one line with the ranges, not one line per stage
    other = {**known, "matmul_peak_gflops": {"float32": 126.31, "bfloat16": 0.5}}
    avx512 = {**known, "instruction_sets": ["avx2", "avx512f"]}
    assert hardware_of_records([{"hardware": known}, {"hardware": avx512}, {"hardware": other}]) == [
        "instruction sets avx2; matmul peak 126.3-152.0 GFLOP/s float32, 0.4-0.5 GFLOP/s bfloat16 (measured at each "
        "of 2 stages' start)", hardware_text(avx512)]


def test_a_report_without_the_hardware_record_renders_its_header_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "plots", lambda results, folder: [])
    old = {"preset": "smoke", "machine": "AMD EPYC, 2 cores, 2 torch threads, torch 2.13.0+cpu",
           "command": "scripts/benchmark.py --preset smoke", "date": "2026-11-24", "dtype": "float32",
           "ffn_chunk": 32, "complete": True, "results": []}
    suites.write_report(old, tmp_path)
    assert (tmp_path / "results.md").read_text().startswith(
        "Preset `smoke` on AMD EPYC, 2 cores, 2 torch threads, torch 2.13.0+cpu (2026-11-24), "
        "`scripts/benchmark.py --preset smoke`.\n\n")
    hardware = {"instruction_sets": ["avx2", "avx512f"], "cores": 2, "torch": "2.13.0+cpu",
                "matmul_peak_gflops": {"float32": 150.0, "bfloat16": 300.0}}
    suites.write_report({**old, "hardware": hardware}, tmp_path)
    assert (tmp_path / "results.md").read_text().startswith(
        "Preset `smoke` on AMD EPYC, 2 cores, 2 torch threads, torch 2.13.0+cpu; instruction sets avx2 avx512f; "
        "matmul peak 150.0 GFLOP/s float32, 300.0 GFLOP/s bfloat16 (2026-11-24), `scripts/benchmark.py")


# Every committed folder of scripts/benchmark.py's suites (their results.json names a preset; the GPU rows and the
# bf16 kernel check write their own formats) but cpu-2core, whose decoder-training table predates the tensor-peak
# column (commit 8f96fad): its results.md was written by the code of its day and would gain that column if rewritten.
REWRITABLE = sorted(p.parent.name for p in (REPO_ROOT / "results" / "benchmarks").glob("*/results.json")
                    if p.parent.name != "cpu-2core" and "preset" in json.loads(p.read_text()))


@pytest.mark.parametrize("folder", REWRITABLE)
def test_committed_benchmark_reports_rewrite_byte_for_byte(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "plots", lambda results, folder: [])  # the PNGs are not compared
    copy = tmp_path / folder
    shutil.copytree(REPO_ROOT / "results" / "benchmarks" / folder, copy)
    suites.rewrite_report(copy)
    committed = REPO_ROOT / "results" / "benchmarks" / folder / "results.md"
    assert (copy / "results.md").read_text() == committed.read_text()


def test_a_measuring_process_finds_the_checkout_from_any_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    spec = {"kind": "kernel", "form": "bidirectional", "dtype": "float32", "n": 32, "heads": 1, "head_dim": 4,
            "chunk": 8, "repeats": 1}
    result = measuring.run_isolated("benchmarks.suites", spec, timeout=300)
    assert "failed" not in result and result["seconds"] > 0, result
    broken = measuring.run_isolated("benchmarks.suites", {**spec, "kind": "no such suite"}, timeout=300)
    assert broken["failed"].startswith("KeyError") and len(broken["failed"]) <= 200


PROBE = """
import json, os, signal, sys, time
import benchmarks.measuring as measuring
spec = json.loads(sys.argv[2])
seen = getattr(measuring, "touched_by", None)
measuring.touched_by = os.getpid()  # a process that is not fresh would show this to the next configuration
if spec["do"] == "sleep":
    time.sleep(60)
elif spec["do"] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif spec["do"] == "raise":
    raise ValueError("probe refused: " + "x" * 400)
elif spec["do"] == "exit":
    sys.exit(3)
print("noise before the result")
print(json.dumps({"pid": os.getpid(), "seen": seen, "cwd": os.getcwd(), "marker": os.environ.get("PROBE_MARKER"),
                  "preloaded": "transformers" in sys.modules and "hf_linear_attn" in sys.modules}))
"""


def test_each_configuration_runs_in_a_fresh_process_and_failures_become_reasons(tmp_path, monkeypatch):
    (tmp_path / "probe_module.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("PROBE_MARKER", "first")
    first = measuring.run_isolated("probe_module", {"do": "report"}, timeout=300)
    monkeypatch.setenv("PROBE_MARKER", "second")  # the environment and folder at each call, not at the server's start
    second = measuring.run_isolated("probe_module", {"do": "report"}, timeout=300)
    assert first["pid"] != second["pid"] and first["seen"] is None and second["seen"] is None
    assert first["preloaded"] and first["cwd"] == str(work)
    assert (first["marker"], second["marker"]) == ("first", "second")

    assert measuring.run_isolated("probe_module", {"do": "sleep"}, timeout=1) == {"failed": "over 1 s"}
    assert measuring.run_isolated("probe_module", {"do": "kill"}, timeout=300) == {"failed": "out of memory (killed)"}
    refused = measuring.run_isolated("probe_module", {"do": "raise"}, timeout=300, reason_chars=50)
    assert refused["failed"].startswith("ValueError: probe refused") and len(refused["failed"]) == 50
    assert measuring.run_isolated("probe_module", {"do": "exit"}, timeout=300) == {"failed": "error"}
    # the server outlives every child it lost: the next configuration runs
    assert measuring.run_isolated("probe_module", {"do": "report"}, timeout=300)["marker"] == "second"
