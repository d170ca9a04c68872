"""Short demo of the encoders: masked-LM training of softmax RoBERTa, Linformer and linear attention on WikiText-2.

Same dimensions, data, steps and seed for the three models; prints a table of validation masked-LM loss and
accuracy, wall time, and checks that each saved checkpoint reloads through AutoModelForMaskedLM with the same
numbers. Uses only the public API (``import hf_linear_attn`` + transformers Auto classes).

    python scripts/demo_encoders.py                      # local WikiText-2 from ../shared/data
    python scripts/demo_encoders.py --dataset hub        # Salesforce/wikitext from the Hub
"""

import math
import sys
from pathlib import Path

import _checkout  # noqa: F401  (experiments/ is beside scripts/, outside the package)

import torch
from transformers import AutoConfig, AutoModelForMaskedLM, DataCollatorForLanguageModeling

import hf_linear_attn  # noqa: F401  (registers linformer / linear_roberta with the Auto classes)
from experiments.demo import demo_arguments, prepare_data, report, train
from hf_linear_attn.training.errors import UsageError

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2"  # ../shared/data beside the checkout


def parse_args():
    parser = demo_arguments(__doc__, DEFAULT_DATA, "outputs/demo", steps=400)
    parser.add_argument("--linformer_k", type=int, default=32)
    return parser.parse_args()


def model_configs(args, vocab_size):
    dims = dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=512, max_position_embeddings=args.seq_len + 2, type_vocab_size=1,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)
    return {
        "roberta (softmax)": AutoConfig.for_model("roberta", **dims),
        f"linformer k={args.linformer_k}": AutoConfig.for_model("linformer", **dims, linformer_k=args.linformer_k),
        "linear attention (elu+1)": AutoConfig.for_model("linear_roberta", **dims),
    }


@torch.no_grad()
def evaluate_mlm(model, batches):
    model.eval()
    loss_sum = correct = count = 0
    for batch in batches:
        logits = model(input_ids=batch["input_ids"]).logits.float()
        target = batch["labels"] != -100
        loss_sum += torch.nn.functional.cross_entropy(logits[target], batch["labels"][target], reduction="sum").item()
        correct += (logits[target].argmax(-1) == batch["labels"][target]).sum().item()
        count += target.sum().item()
    return {"mlm_loss": loss_sum / count, "mlm_accuracy": correct / count}


def main():
    args = parse_args()
    out_dir, tokenizer, train_rows, valid_rows = prepare_data(args)

    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="pt")
    torch.manual_seed(1234)  # the same masked validation batches for every model
    eval_batches = [collator([{"input_ids": r} for r in valid_rows[i: i + args.batch_size]])
                    for i in range(0, args.eval_batches * args.batch_size, args.batch_size)]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16)

    results = {}
    for name, config in model_configs(args, len(tokenizer)).items():
        torch.manual_seed(args.seed)
        model = AutoModelForMaskedLM.from_config(config)
        # dynamic masking, fresh every step
        seconds = train(model, args, name, train_rows, lambda rows: collator([{"input_ids": r} for r in rows]), autocast)
        with autocast:
            metrics = evaluate_mlm(model, eval_batches)
        save_dir = out_dir / name.split()[0]
        model.save_pretrained(save_dir)
        reloaded = AutoModelForMaskedLM.from_pretrained(save_dir)
        with autocast:
            same = evaluate_mlm(reloaded, eval_batches) == metrics
        results[name] = {**metrics, "perplexity": math.exp(metrics["mlm_loss"]), "train_seconds": seconds,
                         "parameters": sum(p.numel() for p in model.parameters()), "reload_identical": same}

    header = "| model | params | val MLM loss | val MLM acc | train time (s) | reload identical |\n|---|---|---|---|---|---|"
    lines = [f"| {n} | {r['parameters']:,} | {r['mlm_loss']:.3f} | {r['mlm_accuracy']:.3f} | {r['train_seconds']:.0f} "
             f"| {r['reload_identical']} |" for n, r in results.items()]
    report(args, out_dir, "\n".join([header, *lines]), results)


if __name__ == "__main__":
    try:
        main()
    except UsageError as error:
        sys.exit(f"error: {error}")
