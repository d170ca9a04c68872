"""The native-bf16 kernel check (scripts/bf16_kernel_check.py, issue 37): a small real run writes its tables, the
profile and errors that can be checked. It needs a CPU that computes bf16 natively and fla's torch reference."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_linear_attn.linear_attention import native_bf16

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not native_bf16("cpu"), reason="needs a CPU with native bf16 products (AVX512-BF16 / AMX)")
def test_small_run_writes_the_table_the_errors_and_the_profile(tmp_path):
    pytest.importorskip("fla", reason="fla's torch chunk form is the peer the check compares with")
    subprocess.run([sys.executable, "scripts/bf16_kernel_check.py", "--output_dir", str(tmp_path), "--n", "128", "256",
                    "--repeats", "1", "--forms", "parallel:64", "scan:64", "--profile"], cwd=ROOT, check=True,
                   capture_output=True)
    result = json.loads((tmp_path / "results.json").read_text())
    assert [(r["n"], r["mode"]) for r in result["rows"]] == [(128, "fwd"), (128, "fwd+bwd"), (256, "fwd"),
                                                             (256, "fwd+bwd")]
    errors = result["rows"][-2]["errors"]  # forward at the longest n, against float64
    assert set(errors) == {"default (auto)", "float32 path", "fla torch chunk", "bf16 parallel C64", "bf16 scan C64"}
    assert all(0 < e < 1e-2 for e in errors.values())
    machine = result["machine"]
    assert machine["peak_gflops_before"]["bfloat16"] > 0 and {"avx512_bf16", "amx_bf16"} & set(machine["flags"])
    shares = [share for _, _, share in result["profile"]["ops"]]
    assert "aten::bmm" in {op for op, _, _ in result["profile"]["ops"]}
    assert all(share > 0 for share in shares) and sum(shares) <= 1 + 1e-9
    markdown = (tmp_path / "results.md").read_text()
    assert "| fwd+bwd | 256 |" in markdown and "the share of the bf16 matmul peak" in markdown
    assert "The products alone" in (tmp_path / "profile.md").read_text()
