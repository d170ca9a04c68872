"""What the two quick demos (scripts/demo_encoders.py, scripts/demo_decoders.py) share: WikiText-2 read from a folder or
the Hub, a byte-level BPE trained on it, packed rows, and one plain training loop (AdamW, linear warmup / decay).
The demos are nanoGPT-sized on purpose: a loop you can read in one sitting, not the training scripts."""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import get_linear_schedule_with_warmup

from hf_linear_attn.training.data import train_bpe_tokenizer
from hf_linear_attn.training.errors import UsageError


def demo_arguments(description: str, default_data: Path, output_dir: str, steps: int) -> argparse.ArgumentParser:
    """The flags both demos take (underscores, as every script here); each demo adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=str(default_data),
                        help="WikiText-2 folder with wiki.{train,valid}.tokens, or 'hub' for Salesforce/wikitext")
    parser.add_argument("--output_dir", default=output_dir)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval_batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_bf16", action="store_true", help="train in float32 instead of bf16 autocast")
    return parser


def load_text(dataset: str):
    """WikiText-2 train / validation lines, from a local folder or the Hub (same code path after loading)."""
    if dataset == "hub":
        raw = load_dataset("Salesforce/wikitext", "wikitext-2-v1")
    else:
        folder = Path(dataset)
        files = {"train": folder / "wiki.train.tokens", "validation": folder / "wiki.valid.tokens"}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise UsageError(f"WikiText-2 files not found: {missing}. Pass --dataset FOLDER or --dataset hub.")
        raw = load_dataset("text", data_files={k: str(v) for k, v in files.items()})
    return raw.filter(lambda row: row["text"].strip() != "")


def pack(raw_split, tokenizer, seq_len):
    """Full-sentence packing: concatenate the token stream and cut it into rows <s> ... </s> of seq_len."""
    ids = [t for row in tokenizer(list(raw_split["text"]), add_special_tokens=False, verbose=False)["input_ids"] for t in row]
    body = seq_len - 2
    rows = [ids[i: i + body] for i in range(0, len(ids) - body + 1, body)]
    return torch.tensor([[tokenizer.bos_token_id, *r, tokenizer.eos_token_id] for r in rows])


def prepare_data(args):
    """(output folder, tokenizer, train rows, validation rows): WikiText-2 read first (a missing folder is a
    UsageError and creates nothing), then a byte-level BPE trained on its train split and saved in the output
    folder, and the packed rows."""
    torch.manual_seed(args.seed)
    raw = load_text(args.dataset)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(list(raw["train"]["text"]), args.vocab_size, "roberta", args.seq_len)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    train_rows, valid_rows = pack(raw["train"], tokenizer, args.seq_len), pack(raw["validation"], tokenizer, args.seq_len)
    print(f"WikiText-2: {len(train_rows)} train rows, {len(valid_rows)} validation rows of {args.seq_len} tokens")
    return out_dir, tokenizer, train_rows, valid_rows


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


def report(args, out_dir: Path, table: str, results: dict, **extra) -> None:
    """Print the run's settings and its table; write results.json (arguments, machine, results, ``extra``) and the
    table as results.md."""
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    print(f"\n{args.steps} steps x batch {args.batch_size} x {args.seq_len} tokens, bf16={not args.no_bf16}, {machine}\n")
    print(table)
    record = {"args": vars(args), "machine": machine, "results": results, **extra}
    (out_dir / "results.json").write_text(json.dumps(record, indent=2))
    (out_dir / "results.md").write_text(table + "\n")
    print(f"\nWrote {out_dir / 'results.json'} and the checkpoints under {out_dir}")
