"""How far bf16 decoding drifts from float32, for the causal block Linformer beside linear attention and GPT-2.

Two measurements, one run, the machine recorded:

* Kernel: causal block-Linformer attention (H 4, d 64, k 64, b 256, n 2,048) on bf16 inputs of std 1 and 3 (sharper
  attention), against float64 computed from the same bf16 values: the whole-sequence bf16 form, token-by-token bf16
  decoding with the state's block summaries in float32 (``block_linformer.state_dtype``, the default) and, as the
  ablation, in bf16 (what the package did before). Error by eighth of the sequence shows whether it grows with the
  position.
* Models: GPT-2, linear_gpt2 (elu + 1) and linformer_gpt2 (k 64, b 256), 4 layers x 256, 4 heads, the same random
  initialisation (seed 0) and the same 2,000 random token ids, teacher-forced: the bf16 model's logits, from a whole
  forward and from decoding one token at a time, against the float32 model's whole forward (top-1 agreement, and the
  largest logit error over the float32 logits' spread). Random weights give near-tied logits, so top-1 agreement is
  a strict test: GPT-2's own bf16 figure is the floor any decoder can reach.

    python scripts/decode_precision.py --output_dir results/benchmarks/decode-precision-<machine>
"""

import argparse
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config

import hf_linear_attn  # noqa: F401  (registers the families with the Auto classes)
from hf_linear_attn import LinearGPT2Config, LinformerGPT2Config, block_linformer
from hf_linear_attn.block_linformer import (
    block_linformer_step,
    causal_block_linformer_attention,
    empty_block_linformer_state,
)

from .measuring import describe_hardware, describe_machine, hardware_text, write_json

HEADS, HEAD_DIM, PROJ_K, BLOCK = 4, 64, 64, 256


@contextmanager
def bf16_summaries():
    """The ablation: the decoding state's block summaries in the model's dtype instead of float32."""
    kept = block_linformer.state_dtype
    block_linformer.state_dtype = lambda dtype: dtype
    try:
        yield
    finally:
        block_linformer.state_dtype = kept


def _by_eighth(error: torch.Tensor) -> list[float]:
    """Mean of a per-position error (n,) over each eighth of the positions."""
    return [part.mean().item() for part in error.chunk(8)]


def kernel_rows(n: int, seed: int = 0) -> list[dict]:
    """Attention-output error against float64 (max over heads and dims per position) for each form and input std."""
    rows = []
    for std in (1.0, 3.0):
        generator = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=generator).mul(std).bfloat16() for _ in range(3))
        e, f = (torch.randn(HEADS, PROJ_K, BLOCK, generator=generator).div(BLOCK**0.5).bfloat16() for _ in range(2))
        reference, _, _ = causal_block_linformer_attention(*(t.double() for t in (q, k, v, e, f)), BLOCK)

        def decoded():
            state = empty_block_linformer_state(1, HEADS, HEAD_DIM, PROJ_K, BLOCK, torch.bfloat16, "cpu")
            outputs = []
            for t in range(n):
                out, state = block_linformer_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, e, f)
                outputs.append(out)
            return torch.cat(outputs, dim=2), state.summary_keys.dtype

        whole, _, _ = causal_block_linformer_attention(q, k, v, e, f, BLOCK)
        forms = [("whole sequence (bf16)", whole, "-")]
        out, dtype = decoded()
        forms.append(("decoding, float32 summaries (default)", out, str(dtype).removeprefix("torch.")))
        with bf16_summaries():
            out, dtype = decoded()
        forms.append(("decoding, bf16 summaries (ablation)", out, str(dtype).removeprefix("torch.")))
        for name, output, summaries in forms:
            error = (output.double() - reference).abs().amax(-1).amax(1)[0]  # (n,)
            rows.append({"input_std": std, "form": name, "summaries": summaries, "max_error": error.max().item(),
                         "rms_error": (output.double() - reference).pow(2).mean().sqrt().item(),
                         "mean_error_by_eighth": _by_eighth(error)})
    return rows


def _configs(n_positions: int) -> dict:
    common = dict(n_layer=4, n_embd=256, n_head=HEADS, n_positions=n_positions, vocab_size=2000, bos_token_id=0,
                  eos_token_id=0)
    return {"gpt2": GPT2Config(**common), "linear_gpt2": LinearGPT2Config(**common),
            "linformer_gpt2": LinformerGPT2Config(**common, linformer_k=PROJ_K, linformer_block_size=BLOCK)}


@torch.no_grad()
def _decoded_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of feeding ``ids`` one token at a time through the model's cache (teacher forcing)."""
    out = model(ids[:, :1], use_cache=True)
    past, steps = out.past_key_values, [out.logits]
    for t in range(1, ids.shape[1]):
        out = model(ids[:, t:t + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


def model_rows(n: int, seed: int = 0) -> list[dict]:
    """Top-1 agreement and logit error of each bf16 model (whole forward, decoding) against its float32 twin."""
    ids = torch.randint(0, 2000, (1, n), generator=torch.Generator().manual_seed(seed))
    rows = []
    for family, config in _configs(n).items():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            reference = model(ids).logits.double()
        spread = reference.std(-1)
        low = AutoModelForCausalLM.from_config(config).eval()
        low.load_state_dict(model.state_dict())
        low = low.to(torch.bfloat16)
        variants = [("whole forward", lambda: low(ids).logits), ("decoding", lambda: _decoded_logits(low, ids))]
        if family == "linformer_gpt2":
            variants.append(("decoding, bf16 summaries (ablation)", lambda: _decoded_logits(low, ids)))
        whole = None
        for name, run in variants:
            began = time.perf_counter()
            with torch.no_grad(), (bf16_summaries() if "ablation" in name else nullcontext()):
                logits = run().double()
            seconds = time.perf_counter() - began
            whole = logits if whole is None else whole
            error = ((logits - reference).abs().amax(-1) / spread)[0]
            rows.append({"family": family, "form": name, "seconds": seconds,
                         "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                         "top1_agreement_with_bf16_whole":
                             (logits.argmax(-1) == whole.argmax(-1)).float().mean().item(),
                         "max_error_over_spread": error.max().item(),
                         "mean_error_over_spread_by_eighth": _by_eighth(error)})
    return rows


def tables(record: dict) -> str:
    eighths = lambda values, fmt: " / ".join(format(v, fmt) for v in (values[0], values[3], values[7]))  # noqa: E731
    out = ["# bf16 decoding against float32: the causal block Linformer, linear attention, GPT-2", "",
           f"Command: `{record['command']}`  ", f"Machine: {record['machine']}; {hardware_text(record['hardware'])}  ",
           f"Wall time: {record['seconds'] / 60:.1f} min"
           + (f" (5-minute load average {record['load_average']:.1f} at the end, {os.cpu_count()} cores: errors do not "
              "depend on it, times do)" if "load_average" in record else ""), "",
           f"## Kernel: causal block-Linformer attention, bf16 inputs (H {HEADS}, d {HEAD_DIM}, k {PROJ_K}, "
           f"b {BLOCK}, n {record['n']})", "",
           "Error of the attention output against float64 from the same bf16 values (per position: the largest over "
           "heads and dims).", "",
           "| input std | form | summaries held in | max error | rms error | mean error: 1st / 4th / 8th eighth |",
           "|---:|---|---|---:|---:|---|"]
    for row in record["kernel"]:
        out.append(f"| {row['input_std']:g} | {row['form']} | {row['summaries']} | {row['max_error']:.2e} | "
                   f"{row['rms_error']:.2e} | {eighths(row['mean_error_by_eighth'], '.2e')} |")
    out += ["", f"## Models: bf16 against the float32 model, teacher-forced over {record['n']:,} random tokens", "",
            "4 layers x 256, 4 heads, random initialisation (seed 0), the same ids for every model. Top-1: the "
            "fraction of positions whose arg-max token equals the float32 model's; error: the largest |logit "
            "difference| over the float32 logits' standard deviation at that position.", "",
            "| model | bf16 form | top-1 = float32 | top-1 = bf16 whole forward | max error | mean error: 1st / 4th / "
            "8th eighth |", "|---|---|---:|---:|---:|---|"]
    for row in record["models"]:
        out.append(f"| {row['family']} | {row['form']} | {row['top1_agreement']:.2%} | "
                   f"{row['top1_agreement_with_bf16_whole']:.2%} | {row['max_error_over_spread']:.3f} | "
                   f"{eighths(row['mean_error_over_spread_by_eighth'], '.4f')} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--n", type=int, default=2048, help="sequence length (a multiple of 256 covers whole blocks)")
    args = parser.parse_args(argv)
    if args.n < 2:
        parser.error(f"--n must be at least 2 (got {args.n})")
    began = time.perf_counter()
    record = {"command": f"python scripts/decode_precision.py --output_dir {args.output_dir}"
                         + (f" --n {args.n}" if args.n != 2048 else ""),
              "machine": describe_machine(), "hardware": describe_hardware("cpu"), "n": args.n,
              "kernel": kernel_rows(args.n), "models": model_rows(args.n)}
    record["seconds"], record["load_average"] = time.perf_counter() - began, os.getloadavg()[1]
    folder = Path(args.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "results.json", record)
    (folder / "results.md").write_text(tables(record))
    print(tables(record))
    return 0
