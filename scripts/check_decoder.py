"""Check a causal-LM checkpoint for the two faults that flatter perplexity or break generation:

    python scripts/check_decoder.py --model_name_or_path results/reproduction/decoders-n512/decoders/linear-attention-gla-gate

1. Causality: the logits at positions before `--cut` must not change when every token from `--cut` on is replaced
   (a kernel that leaks later tokens into earlier positions scores a perplexity no causal model can reach).
2. The recurrent form: a prefill of `--prefix` tokens, then `--steps` tokens one at a time through the cache, must
   give the full forward's logits at those positions (what generate() runs is what the perplexity measured).

Random token ids (seeded), float32, eval mode. Prints both maximum differences and exits 1 if either is beyond
`--tolerance`. Not always exactly 0 for a causal model: the chunked gated kernel scales a chunk's keys and queries
by decays relative to the chunk's end, which cancel in exact arithmetic but round differently when a later token's
gate changes (measured: 3e-6 on logits of about 13); a leak moves them by the size of the logits. Works for any
decoder AutoModelForCausalLM loads (this package's families, stock GPT-2).
"""

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM

import hf_linear_attn  # noqa: F401  (registers the families with the Auto classes)


def check(model, length: int, cut: int, prefix: int, steps: int, seed: int = 0) -> dict:
    """{'causal_change': max |logit change| before `cut`, 'later_change': after it (must be > 0, or the check saw
    nothing), 'recurrent_difference': max |step logits - forward logits|, 'logit_scale': max |logit|}."""
    if not 0 < cut < length or not 0 < prefix < prefix + steps <= length:
        raise SystemExit(f"error: need 0 < cut < length and 0 < prefix < prefix + steps <= length, got length={length}, "
                         f"cut={cut}, prefix={prefix}, steps={steps}: choose values inside the length")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, length), generator=generator)
    changed = ids.clone()
    changed[:, cut:] = torch.randint(3, vocab, (2, length - cut), generator=generator)
    with torch.no_grad():
        logits = model(ids).logits.float()
        other = model(changed).logits.float()
        out = model(ids[:, :prefix], use_cache=True)
        cache, stepped = out.past_key_values, [out.logits[:, -1].float()]
        for t in range(prefix, prefix + steps):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            stepped.append(out.logits[:, -1].float())
    stepped = torch.stack(stepped[:-1], dim=1)  # predictions at positions prefix - 1 ... prefix + steps - 2
    return {
        "causal_change": (logits[:, :cut] - other[:, :cut]).abs().max().item(),
        "later_change": (logits[:, cut:] - other[:, cut:]).abs().max().item(),
        "recurrent_difference": (stepped - logits[:, prefix - 1 : prefix + steps - 1]).abs().max().item(),
        "logit_scale": logits.abs().max().item(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--length", type=int, help="tokens per row (default: the model's positions, at most 512)")
    parser.add_argument("--cut", type=int, help="first replaced position (default: 60%% of the length)")
    parser.add_argument("--prefix", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest logit difference allowed (earlier positions; cached steps against the forward)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).eval()
    length = args.length or min(getattr(model.config, "n_positions", 512), 512)
    cut = args.cut or int(0.6 * length)
    result = check(model, length, cut, args.prefix, args.steps)
    print(f"causal: max logit change before position {cut} when every later token changes: "
          f"{result['causal_change']:.3g} (after it: {result['later_change']:.3g})")
    print(f"recurrent: max |logit difference| of {args.steps} cached steps against the full forward: "
          f"{result['recurrent_difference']:.3g} (logits up to {result['logit_scale']:.3g})")
    failed = (result["causal_change"] > args.tolerance or result["later_change"] <= 10 * args.tolerance
              or result["recurrent_difference"] > args.tolerance)
    print("FAILED" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
