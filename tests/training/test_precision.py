"""Mixed precision: what "auto" picks on CPUs with and without native bf16, and several runs in one process."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from accelerate.state import AcceleratorState

from hf_linear_attn.training import accelerator as run_accelerator  # where pretraining makes its Accelerator

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f_is_not_here\n"
ZEN5 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni\n"
# AVX-512 without its bf16 products (an Intel Xeon, 2026-12-07): bf16 is emulated there, about 5x slower than float32
XEON_AVX512 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_vbmi2\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
# a flag's name inside another line must not count: only the "flags" lines list instruction sets
BF16_IN_A_BUG_LINE = "processor\t: 0\nflags\t\t: fpu avx2\nbugs\t\t: avx512_bf16_imaginary\n"


@pytest.mark.parametrize("cpuinfo, expected", [(AVX2_ONLY, "no"), (ZEN5, "bf16"), (SAPPHIRE_RAPIDS, "bf16"),
                                               (BF16_IN_A_BUG_LINE, "no"), (XEON_AVX512, "no")])
def test_auto_precision_follows_the_cpus_instruction_set(tmp_path, monkeypatch, cpuinfo, expected):
    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo)
    monkeypatch.setattr(run_accelerator, "CPUINFO", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_accelerator.resolve_mixed_precision("auto") == expected
    # an explicit choice is never second-guessed
    assert run_accelerator.resolve_mixed_precision("no") == "no"
    assert run_accelerator.resolve_mixed_precision("bf16") == "bf16"


@pytest.mark.parametrize("cpuinfo, warned", [(AVX2_ONLY, True), (XEON_AVX512, True), (ZEN5, False)])
def test_finetuning_with_bf16_on_a_cpu_that_emulates_it_warns_before_it_starts(tmp_path, monkeypatch, cpuinfo, warned):
    """--bf16 is what the user asked for, so it runs; where the CPU emulates bf16 they are told it is slower than
    float32 and how to get float32, before any work."""
    from transformers import TrainingArguments

    from hf_linear_attn.training.finetuning_arguments import FinetuneArguments, check_arguments

    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo)
    monkeypatch.setattr(run_accelerator, "CPUINFO", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    training = TrainingArguments(output_dir=str(tmp_path / "out"), bf16=True, use_cpu=True, report_to="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_arguments(FinetuneArguments(model_name_or_path="m", task_name="sst2"), training)
    said = [str(w.message) for w in caught if "--bf16" in str(w.message)]
    assert bool(said) == warned
    assert not said or "emulated" in said[0] and "leave --bf16 out" in said[0]


def test_auto_precision_without_a_readable_cpuinfo_claims_no_bf16(tmp_path, monkeypatch):
    monkeypatch.setattr(run_accelerator, "CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_accelerator.resolve_mixed_precision("auto") == "no"


def test_runs_with_different_precisions_follow_each_other_in_one_process(tmp_path):
    """accelerate refuses a second Accelerator with another precision in the same process; the training code
    must not (a native-bf16 CPU resolves "auto" to bf16, an earlier run or Trainer may have left "no")."""
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        seen = []
        for precision in ("no", "bf16", "bf16", "no"):
            args = SimpleNamespace(mixed_precision=precision, report_to="none", output_dir=str(tmp_path))
            accelerator = run_accelerator.make_accelerator(args)
            seen.append(accelerator.mixed_precision)
            # the precision is really in force, not only recorded
            with accelerator.autocast():
                product = torch.ones(4, 4) @ torch.ones(4, 4)
            assert product.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        assert seen == ["no", "bf16", "bf16", "no"]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
