"""scripts/decode_precision.py end to end at a tiny length: the tables it writes hold every form, and its numbers
are what they claim (errors against float64 are small and non-negative, the float32 twin agrees with itself)."""

import json

from benchmarks.decode_precision import main


def test_a_short_run_writes_every_kernel_form_and_model_row(tmp_path):
    assert main(["--output_dir", str(tmp_path), "--n", "24"]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    forms = [(row["input_std"], row["form"], row["summaries"]) for row in record["kernel"]]
    assert [f[2] for f in forms] == ["-", "float32", "bfloat16"] * 2  # the ablation really held bf16 summaries
    assert all(0 <= row["rms_error"] <= row["max_error"] < 0.5 for row in record["kernel"])
    models = [(row["family"], row["form"]) for row in record["models"]]
    assert models == [("gpt2", "whole forward"), ("gpt2", "decoding"), ("linear_gpt2", "whole forward"),
                      ("linear_gpt2", "decoding"), ("linformer_gpt2", "whole forward"), ("linformer_gpt2", "decoding"),
                      ("linformer_gpt2", "decoding, bf16 summaries (ablation)")]
    for row in record["models"]:
        assert 0.8 <= row["top1_agreement"] <= 1 and 0 < row["max_error_over_spread"] < 0.5
        assert row["form"] != "whole forward" or row["top1_agreement_with_bf16_whole"] == 1
    table = (tmp_path / "results.md").read_text()
    assert "decoding, float32 summaries (default)" in table and "instruction sets" in table
