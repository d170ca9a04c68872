"""Short demo of the encoders: masked-LM training of softmax RoBERTa, Linformer and linear attention on WikiText-2.

Same dimensions, data, steps and seed for the three models; prints a table of validation masked-LM loss and
accuracy, wall time, and checks that each saved checkpoint reloads through AutoModelForMaskedLM with the same
numbers. Uses only the public API (``import hf_linear_attn`` + transformers Auto classes).

    python scripts/demo_encoders.py                      # local WikiText-2 from ../shared/data
    python scripts/demo_encoders.py --dataset hub        # Salesforce/wikitext from the Hub
"""

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    get_linear_schedule_with_warmup,
)

import hf_linear_attn  # noqa: F401  (registers linformer / linear_roberta with the Auto classes)
from hf_linear_attn.training.data import train_bpe_tokenizer

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=str(DEFAULT_DATA),
                        help="folder with wiki.train.tokens / wiki.valid.tokens, or 'hub' for Salesforce/wikitext")
    parser.add_argument("--output-dir", default="outputs/demo")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--linformer-k", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-bf16", action="store_true", help="train in float32 instead of bf16 autocast")
    return parser.parse_args()


def load_text(dataset: str):
    """WikiText-2 train / validation lines, from a local folder or the Hub (same code path after loading)."""
    if dataset == "hub":
        raw = load_dataset("Salesforce/wikitext", "wikitext-2-v1")
    else:
        folder = Path(dataset)
        files = {"train": folder / "wiki.train.tokens", "validation": folder / "wiki.valid.tokens"}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise SystemExit(f"WikiText-2 files not found: {missing}. Pass --dataset FOLDER or --dataset hub.")
        raw = load_dataset("text", data_files={k: str(v) for k, v in files.items()})
    return raw.filter(lambda row: row["text"].strip() != "")


def pack(raw_split, tokenizer, seq_len):
    """Full-sentence packing: concatenate the token stream and cut it into rows <s> ... </s> of seq_len."""
    ids = [t for row in tokenizer(list(raw_split["text"]), add_special_tokens=False, verbose=False)["input_ids"] for t in row]
    body = seq_len - 2
    rows = [ids[i: i + body] for i in range(0, len(ids) - body + 1, body)]
    return torch.tensor([[tokenizer.bos_token_id, *r, tokenizer.eos_token_id] for r in rows])


def model_configs(args, vocab_size):
    dims = dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=512, max_position_embeddings=args.seq_len + 2, type_vocab_size=1,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)
    return {
        "roberta (softmax)": AutoConfig.for_model("roberta", **dims),
        f"linformer k={args.linformer_k}": AutoConfig.for_model("linformer", **dims, linformer_k=args.linformer_k),
        "linear attention (elu+1)": AutoConfig.for_model("linear_roberta", **dims),
    }


def prepare_data(args, out_dir):
    """Byte-level BPE trained on WikiText-2 train (saved under out_dir), and packed train / validation rows."""
    torch.manual_seed(args.seed)
    raw = load_text(args.dataset)
    tokenizer = train_bpe_tokenizer(list(raw["train"]["text"]), args.vocab_size, "roberta", args.seq_len)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    train_rows, valid_rows = pack(raw["train"], tokenizer, args.seq_len), pack(raw["validation"], tokenizer, args.seq_len)
    print(f"WikiText-2: {len(train_rows)} train rows, {len(valid_rows)} validation rows of {args.seq_len} tokens")
    return tokenizer, train_rows, valid_rows


def train(model, args, name, train_rows, make_batch, autocast) -> float:
    """AdamW + linear warmup / decay for args.steps random batches of make_batch(rows); returns the seconds taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = get_linear_schedule_with_warmup(optimizer, args.steps // 10, args.steps)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        index = torch.randint(len(train_rows), (args.batch_size,), generator=generator)
        with autocast:
            loss = model(**make_batch(train_rows[index])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"  {name:32s} step {step + 1:5d}  loss {loss.item():.3f}")
    return time.perf_counter() - start


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
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, train_rows, valid_rows = prepare_data(args, out_dir)

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
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    table = "\n".join([header, *lines])
    print(f"\n{args.steps} steps x batch {args.batch_size} x {args.seq_len} tokens, bf16={not args.no_bf16}, {machine}\n")
    print(table)
    (out_dir / "results.json").write_text(json.dumps({"args": vars(args), "machine": machine, "results": results},
                                                     indent=2))
    (out_dir / "results.md").write_text(table + "\n")
    print(f"\nWrote {out_dir / 'results.json'} and the checkpoints under {out_dir}")


if __name__ == "__main__":
    main()
