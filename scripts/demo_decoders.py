"""Short demo of the decoders: causal-LM training of softmax GPT-2, linear attention and the causal Linformer.

Same dimensions, data (WikiText-2), steps and seed for the three; prints a table of validation loss / perplexity,
training time, then generates from a validation prompt with ``generate()``: per-token latency, the size of the
cache after the prompt and after generation (GPT-2's key/value cache grows with every token; the linear decoder's
state does not), and whether the saved checkpoint, reloaded through AutoModelForCausalLM, generates the same tokens.
Uses only the public API (``import hf_linear_attn`` + transformers Auto classes).

    python scripts/demo_decoders.py                      # local WikiText-2 from ../shared/data
    python scripts/demo_decoders.py --dataset hub        # Salesforce/wikitext from the Hub
"""

import math
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401  (experiments/ is beside scripts/, outside the package)

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_linear_attn  # noqa: F401  (registers linear_gpt2 / linformer_gpt2 with the Auto classes)
from experiments.demo import demo_arguments, prepare_data, report, train
from hf_linear_attn.training.errors import UsageError

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2"  # ../shared/data beside the checkout


def parse_args():
    parser = demo_arguments(__doc__, DEFAULT_DATA, "outputs/demo-decoders", steps=300)
    parser.add_argument("--block_size", type=int, default=32, help="causal Linformer block length b")
    parser.add_argument("--linformer_k", type=int, default=8, help="causal Linformer summary rows k per block")
    parser.add_argument("--new_tokens", type=int, default=64, help="tokens generated per model")
    return parser.parse_args()


def model_configs(args, vocab_size):
    # n_positions leaves room for a prompt of seq_len tokens plus the generated ones
    dims = dict(vocab_size=vocab_size, n_positions=args.seq_len + args.new_tokens + 1, n_embd=128, n_layer=2,
                n_head=4, n_inner=512, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    return {
        "gpt2 (softmax)": AutoConfig.for_model("gpt2", **dims),
        "linear attention (elu+1)": AutoConfig.for_model("linear_gpt2", **dims),
        f"causal linformer k={args.linformer_k} b={args.block_size}": AutoConfig.for_model(
            "linformer_gpt2", **dims, linformer_k=args.linformer_k, linformer_block_size=args.block_size
        ),
    }


@torch.no_grad()
def evaluate_lm(model, rows, batch_size, batches):
    """Mean next-token cross-entropy over the first ``batches`` validation batches."""
    model.eval()
    loss_sum = count = 0
    for i in range(0, batches * batch_size, batch_size):
        ids = rows[i: i + batch_size]
        logits = model(input_ids=ids).logits[:, :-1].float()
        loss_sum += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                      reduction="sum").item()
        count += ids[:, 1:].numel()
    return {"val_loss": loss_sum / count, "perplexity": math.exp(loss_sum / count)}


def cache_bytes(cache) -> int:
    """Bytes held by a generation cache: our recurrent state, or the key/value tensors of a DynamicCache."""
    if hasattr(cache, "state_bytes"):
        return cache.state_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def generate_and_time(model, prompt, new_tokens):
    """Greedy generation: tokens, per-token latency (median of the decoding steps) and cache bytes before / after."""
    model.eval()
    out = model(prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    prompt_cache = cache_bytes(cache)
    step_seconds = []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        step_seconds.append(time.perf_counter() - start)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    generated = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=1)
    return generated, sorted(step_seconds)[len(step_seconds) // 2], prompt_cache, cache_bytes(cache)


def main():
    args = parse_args()
    out_dir, tokenizer, train_rows, valid_rows = prepare_data(args)
    prompt = valid_rows[-1:, : args.seq_len - 1]  # <s> + a validation passage the models never trained on
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16)

    results, samples = {}, {}
    for name, config in model_configs(args, len(tokenizer)).items():
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config)
        seconds = train(model, args, name, train_rows, lambda rows: {"input_ids": rows, "labels": rows}, autocast)
        with autocast:
            metrics = evaluate_lm(model, valid_rows, args.batch_size, args.eval_batches)
        generated, latency, prompt_cache, final_cache = generate_and_time(model, prompt, args.new_tokens)
        save_dir = out_dir / name.split()[0]
        model.save_pretrained(save_dir)
        reloaded = AutoModelForCausalLM.from_pretrained(save_dir).eval()
        same = torch.equal(reloaded.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                             do_sample=False, pad_token_id=1), generated)
        results[name] = {**metrics, "train_seconds": seconds, "parameters": sum(p.numel() for p in model.parameters()),
                         "ms_per_token": 1e3 * latency, "cache_bytes_after_prompt": prompt_cache,
                         "cache_bytes_after_generation": final_cache, "reload_generates_same": same}
        samples[name] = tokenizer.decode(generated[0, prompt.shape[1]:], skip_special_tokens=True)

    header = ("| model | params | val loss | val ppl | train time (s) | ms / token | cache after prompt -> after "
              f"{args.new_tokens} tokens (KB) | reload generates same |\n|---|---|---|---|---|---|---|---|")
    lines = [f"| {n} | {r['parameters']:,} | {r['val_loss']:.3f} | {r['perplexity']:.1f} | {r['train_seconds']:.0f} "
             f"| {r['ms_per_token']:.1f} | {r['cache_bytes_after_prompt'] / 1e3:.0f} -> "
             f"{r['cache_bytes_after_generation'] / 1e3:.0f} | {r['reload_generates_same']} |" for n, r in results.items()]
    for name, text in samples.items():
        print(f"\n{name}: ...{text[:300]!r}")
    report(args, out_dir, "\n".join([header, *lines]), results, samples=samples)


if __name__ == "__main__":
    try:
        main()
    except UsageError as error:
        sys.exit(f"error: {error}")
