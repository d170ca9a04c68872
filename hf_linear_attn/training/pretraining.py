"""Masked-LM (encoders) and causal-LM (decoders) pretraining with accelerate, resumable exactly: the training loop.

`run_pretraining` reads as its steps: the Accelerator (accelerator.py), the checks and inputs (pretraining_setup.py),
the run's folder and the checkpoint to resume from (run_state.py), then the loop here and the final model.
Exactness on `--resume` rests, besides the checkpoints (run_state.py), on two choices made here:
- the data order is a permutation drawn from (seed, epoch), and a resumed run skips the batches already consumed
  (`accelerator.skip_first_batches`), so no sampler state has to survive;
- the masked-LM masks of each micro-batch come from a generator seeded by (seed, step, micro-batch, process), not
  from the global RNG, which the data loader's read-ahead would otherwise advance before a checkpoint is taken.
Under FSDP (`accelerate launch --config_file configs/accelerate/fsdp-*.yaml`, see fsdp.py) the same checkpoints hold
the model and optimizer as one shard per process; the final model is gathered and saved whole.
"""

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader, StackDataset, Subset
from tqdm.auto import tqdm
from transformers import DataCollatorForLanguageModeling, get_scheduler
from transformers.modeling_outputs import MaskedLMOutput

import hf_linear_attn  # noqa: F401  (registers the package's models with the Auto classes)
from hf_linear_attn.families import max_model_length

from .accelerator import make_accelerator, resolve_mixed_precision  # noqa: F401  (resolve_...: its old address)
from .arguments import SECRET_ARGUMENTS
from .checkpoints import disk_full_error, is_disk_full
from .errors import UsageError
from .fsdp import checkpoint_layout, gathered_state_dict, original_class
from .hub import hub_repo_id, push_folder
from .model_cards import write_pretraining_card
from .pretraining_arguments import PretrainArguments, check_arguments
from .pretraining_setup import check_fsdp_wrapping, load_model_config, objective_for, prepare_model_and_data
from .run_state import (  # noqa: F401  (checkpoints_in: its old address, as the experiments import it)
    CHECKPOINTS, RUN_ARGS, check_output_dir, checkpoints_in, drop_replaced_run, release_output_dir, save_checkpoint,
    trainer_state, verify_restored_rng,
)


class MaskedTokensLoss(torch.nn.Module):
    """A masked LM whose output head runs on the masked tokens only, as fairseq computes RoBERTa's loss.

    `forward(input_ids, labels).loss` is `model(input_ids, labels=labels).loss` (mean cross-entropy over labels !=
    -100) without the (batch, n, vocab) logits of the ~85% of tokens that carry no label: at a vocabulary of 8,000
    and width 256 those logits and their log-softmax were half of a CPU training step. For models with a base model
    and an `lm_head` module (RoBERTa and this package's encoders); `supports` says whether a model has them.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    @staticmethod
    def supports(model) -> bool:
        return isinstance(getattr(model, "lm_head", None), torch.nn.Module) and model.base_model is not model

    def forward(self, input_ids, labels=None, attention_mask=None):
        """input_ids, labels (batch, n) -> MaskedLMOutput with the loss only; without labels the model's own output
        (every token's logits), which is how evaluation runs under FSDP: only the root module's forward gathers the
        sharded weights outside the layers (embeddings, LM head)."""
        if labels is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask)
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        picked = labels != -100
        logits = self.model.lm_head(hidden[picked])  # (masked tokens, vocab)
        return MaskedLMOutput(loss=torch.nn.functional.cross_entropy(logits, labels[picked]))


def _optimizer(model, args: PretrainArguments):
    """AdamW without weight decay on biases and LayerNorm weights (the RoBERTa / GPT-2 recipe)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon)


class BatchStream:
    """Training batches forever, epoch after epoch, each epoch a permutation drawn from (seed, epoch).

    `start(consumed)` positions the stream after `consumed` micro-batches of this process, which is how a resumed
    run finds its place in the data without any saved sampler state.
    """

    def __init__(self, accelerator: Accelerator, dataset, batch_size: int, seed: int):
        self.accelerator, self.dataset, self.batch_size, self.seed = accelerator, dataset, batch_size, seed
        self.per_epoch = len(self._loader(0))
        if self.per_epoch == 0:
            raise UsageError(f"{len(dataset)} training rows do not make one batch of {batch_size} per process; "
                                "lower --per_device_train_batch_size or add data")

    def _loader(self, epoch: int):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))
        # A loader without its own generator draws a seed from the global RNG each time it is iterated, which
        # would shift the dropout stream of a resumed run (its loaders start at different times).
        loader = DataLoader(Subset(self.dataset, order.tolist()), batch_size=self.batch_size, drop_last=True,
                            generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.accelerator.prepare_data_loader(loader)

    def start(self, consumed: int):
        epoch, skip = divmod(consumed, self.per_epoch)
        while True:
            loader = self._loader(epoch)
            if skip:
                loader = self.accelerator.skip_first_batches(loader, skip)
            yield from loader
            epoch, skip = epoch + 1, 0


def _mask(batch, tokenizer, args: PretrainArguments, seed: int):
    """RoBERTa's dynamic masking (15%: 80% <mask>, 10% random, 10% kept) with a generator seeded by `seed`."""
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability, seed=seed)
    masked = collator([{"input_ids": row} for row in batch["input_ids"].cpu()])
    return {k: v.to(batch["input_ids"].device) for k, v in masked.items() if k in ("input_ids", "labels")}


def _items(batch, objective: str) -> int:
    """Tokens the loss averages over: masked tokens (mlm) or predicted next tokens (clm)."""
    if objective == "mlm":
        return int((batch["labels"] != -100).sum())
    return int((batch["labels"][:, 1:] != -100).sum())


@torch.no_grad()
def evaluate_perplexity(model, accelerator: Accelerator, rows: dict, batch_size: int, objective: str) -> dict:
    """Validation loss (mean over all predicted tokens of all processes) and its exp, the perplexity."""
    model.eval()
    loader = accelerator.prepare_data_loader(DataLoader(StackDataset(**rows), batch_size=batch_size,
                                                        generator=torch.Generator().manual_seed(0)))
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in loader:
        with accelerator.autocast():  # the training precision, whether or not `model` is the prepared module
            logits = model(input_ids=batch["input_ids"]).logits.float()
        labels = batch["labels"]
        if objective == "clm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        per_row = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(-1)
        tokens = (labels != -100).sum(-1)
        # gather_for_metrics drops the rows repeated to make the last batch even across processes
        per_row, tokens = accelerator.gather_for_metrics((per_row, tokens))
        loss_sum += per_row.double().sum()
        count += tokens.double().sum()
    model.train()
    loss = (loss_sum / count).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "eval_tokens": int(count.item())}


def evaluation_rows(validation, tokenizer, args: PretrainArguments, objective: str) -> dict:
    """The validation batch every evaluation scores: for masked LM one fixed masking, the same for every
    evaluation and every model."""
    if args.max_eval_samples is not None:  # at least 1 (check_arguments)
        validation = validation.select(range(min(args.max_eval_samples, len(validation))))
    ids = validation[:]["input_ids"]  # one (rows, seq_len) tensor
    if objective == "mlm":
        return _mask({"input_ids": ids}, tokenizer, args, seed=args.seed + 1)
    return {"input_ids": ids, "labels": ids.clone()}


def prepare_training(args: PretrainArguments, accelerator: Accelerator, model, objective: str):
    """(trained module, optimizer, scheduler), prepared by accelerate. The trained module is the masked LM with its
    head on masked tokens only where the model allows it, else the model itself."""
    optimizer = _optimizer(model, args)
    world = accelerator.num_processes
    # accelerate steps a prepared scheduler once per process per optimizer step: scale its lengths to match
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                              num_warmup_steps=math.ceil(args.warmup_ratio * args.max_steps) * world,
                              num_training_steps=args.max_steps * world)
    trained = MaskedTokensLoss(model) if objective == "mlm" and MaskedTokensLoss.supports(model) else model
    return accelerator.prepare(trained, optimizer, scheduler)


def optimizer_step(accelerator: Accelerator, trained, optimizer, scheduler, micro: list[dict], objective: str,
                   max_grad_norm: float) -> tuple[torch.Tensor, int]:
    """One optimizer step over the micro-batches of every process; returns (this process's loss x tokens, the
    tokens of every process). The step's loss is the mean over every predicted token of every process."""
    world = accelerator.num_processes
    counts = [_items(b, objective) for b in micro]
    total = accelerator.reduce(torch.tensor(sum(counts), device=accelerator.device), "sum").item()
    loss_sum = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(micro):
        sync = i == len(micro) - 1
        with nullcontext() if sync else accelerator.no_sync(trained):
            loss = trained(**batch).loss
            # DDP averages gradients over processes, hence * world
            accelerator.backward(loss * (counts[i] * world / max(total, 1)))
        loss_sum += loss.detach().float() * counts[i]
    if max_grad_norm > 0:
        accelerator.clip_grad_norm_(trained.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss_sum, total


@dataclass
class TrainingRun:
    """What the loop works on, prepared by accelerate: the model, the module trained (the model, or the masked-LM
    loss on masked tokens around it), the module evaluated, optimizer, scheduler, the batch stream and the fixed
    validation rows."""

    model: torch.nn.Module
    trained: torch.nn.Module
    evaluated: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    stream_source: BatchStream
    eval_rows: dict

    def release(self) -> None:
        """Drop the prepared modules before accelerate's end_training: it destroys the process group, and a DDP
        wrapper freed after the group (its reducer holds the group) joined gloo threads that never ended: a 2-process
        run hung there at exit (seen once)."""
        self.trained = self.evaluated = self.optimizer = self.scheduler = self.stream_source = None


def check_run(args: PretrainArguments, accelerator: Accelerator) -> tuple[object, str, Path | None]:
    """(model config, objective, checkpoint to resume from or None): everything checked before any data is read or
    anything written."""
    config = load_model_config(args)
    objective = objective_for(config, args.objective)
    check_arguments(args, objective)
    check_fsdp_wrapping(accelerator, config, objective, args)
    resume_from = check_output_dir(args, accelerator.num_processes, checkpoint_layout(accelerator))
    return config, objective, resume_from


def start_run(args: PretrainArguments, accelerator: Accelerator, model, tokenizer, packed, objective: str,
              claim: dict | None) -> TrainingRun:
    """The run prepared for its first step; a refusal on the way leaves output_dir as it was found (`claim`)."""
    try:
        eval_rows = evaluation_rows(packed["validation"], tokenizer, args, objective)
        trained, optimizer, scheduler = prepare_training(args, accelerator, model, objective)
        stream_source = BatchStream(accelerator, packed["train"], args.per_device_train_batch_size, args.seed)
    except Exception:  # a refusal, or any other failure before training: the folder as it was found
        if claim is not None:
            release_output_dir(args, accelerator, claim)
        raise
    drop_replaced_run(accelerator, claim)
    # Under FSDP the weights outside the layers are gathered only by the prepared (root) module's forward
    evaluated = trained if accelerator.distributed_type == DistributedType.FSDP else model
    return TrainingRun(model, trained, evaluated, optimizer, scheduler, stream_source, eval_rows)


def resume(args: PretrainArguments, accelerator: Accelerator, run: TrainingRun, resume_from: Path) -> tuple[int, list]:
    """Load the checkpoint (checked: RNG states restored), and return (its step, its log history); a raised
    --max_steps redraws the schedule over the new length, said with the learning rate before and after."""
    output_dir = Path(args.output_dir)
    try:
        accelerator.load_state(str(resume_from))
    except Exception as error:  # a file damaged in a way the header and content checks cannot see
        raise UsageError(f"cannot load the checkpoint {resume_from}: {type(error).__name__}: {error}. Resume "
                         "from an older one with --resume_from_checkpoint") from error
    verify_restored_rng(accelerator, resume_from, args.allow_inexact_resume)
    saved_state = json.loads((resume_from / "trainer_state.json").read_text())
    start_step = saved_state.get("global_step", saved_state["step"])
    accelerator.print(f"resumed from {resume_from} at step {start_step}")
    previous_max = json.loads((output_dir / RUN_ARGS).read_text()).get("max_steps", args.max_steps)
    if start_step >= args.max_steps:
        raise UsageError(f"the checkpoint {resume_from} is at step {start_step}, --max_steps is {args.max_steps}: "
                         "nothing left to train; pass a larger --max_steps to continue")
    if previous_max != args.max_steps:
        scheduler = run.scheduler
        inner = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps the LambdaLR
        lr_next = (inner.lr_lambdas[0](inner.last_epoch) * inner.base_lrs[0] if hasattr(inner, "lr_lambdas")
                   else inner.get_last_lr()[0])
        accelerator.print(
            f"--max_steps raised from {previous_max} to {args.max_steps}: the learning-rate schedule "
            f"({args.lr_scheduler_type}, warmup {args.warmup_ratio:g} of the steps) is now drawn over "
            f"{args.max_steps} steps; the learning rate after step {start_step} is {lr_next:.3g} "
            f"(it was {scheduler.get_last_lr()[0]:.3g} under the {previous_max}-step schedule)")
        if accelerator.is_main_process:
            record = json.loads((output_dir / RUN_ARGS).read_text())
            (output_dir / RUN_ARGS).write_text(json.dumps({**record, "max_steps": args.max_steps}, indent=2))
    return start_step, list(saved_state.get("log_history", []))


def train(args: PretrainArguments, accelerator: Accelerator, run: TrainingRun, tokenizer, objective: str,
          start_step: int, log_history: list) -> dict:
    """The loop from `start_step` to --max_steps: logs every --logging_steps, validation every --eval_steps,
    checkpoints every --save_steps (appended to `log_history`); returns the last validation metrics."""
    world = accelerator.num_processes
    output_dir = Path(args.output_dir)
    stream = run.stream_source.start(start_step * args.gradient_accumulation_steps)
    progress = tqdm(total=args.max_steps, initial=start_step, disable=not accelerator.is_local_main_process,
                    desc="pretraining")
    run.model.train()
    metrics = {}
    running_loss = torch.zeros((), device=accelerator.device)  # this process's loss x tokens since the last log
    running_items = 0  # tokens of every process since the last log
    for step in range(start_step, args.max_steps):
        micro = [next(stream) for _ in range(args.gradient_accumulation_steps)]
        if objective == "mlm":
            micro = [_mask(b, tokenizer, args, seed=args.seed * 1_000_003 + (step * len(micro) + i) * world
                           + accelerator.process_index) for i, b in enumerate(micro)]
        else:
            micro = [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in micro]
        loss_sum, items = optimizer_step(accelerator, run.trained, run.optimizer, run.scheduler, micro, objective,
                                         args.max_grad_norm)
        running_loss += loss_sum
        running_items += items
        progress.update(1)
        done = step + 1
        if done % args.logging_steps == 0 or done == args.max_steps:
            # reduced only here: no extra synchronisation in the steps between logs
            loss_sum = accelerator.reduce(running_loss, "sum").item()
            logs = {"loss": loss_sum / max(running_items, 1), "learning_rate": run.scheduler.get_last_lr()[0]}
            running_loss.zero_()
            running_items = 0
            progress.set_postfix(loss=f"{logs['loss']:.3f}")
            accelerator.log(logs, step=done)
            log_history.append({**logs, "step": done})
        if done % args.eval_steps == 0 or done == args.max_steps:
            metrics = evaluate_perplexity(run.evaluated, accelerator, run.eval_rows, args.per_device_eval_batch_size,
                                          objective)
            accelerator.log(metrics, step=done)
            log_history.append({**metrics, "step": done})
            if accelerator.is_main_process:
                progress.write(f"step {done}: validation loss {metrics['eval_loss']:.4f}, "
                               f"perplexity {metrics['perplexity']:.2f}")
        if done % args.save_steps == 0 and done != args.max_steps:
            save_checkpoint(accelerator, output_dir, done, args.save_total_limit,
                            trainer_state(done, args.max_steps, log_history, args, world))
    progress.close()
    return metrics


def save_final_model(args: PretrainArguments, accelerator: Accelerator, run: TrainingRun, tokenizer, results: dict,
                     log_history: list) -> None:
    """Model (gathered whole under FSDP), tokenizer, train_results.json and trainer_state.json into output_dir; a full
    disk is named."""
    output_dir = Path(args.output_dir)
    full_state = gathered_state_dict(accelerator, run.trained, run.model)  # FSDP: every process sends its shards
    if accelerator.is_main_process:
        try:
            # the module inside `trained`, trained in place; under FSDP its whole weights gathered above
            with original_class(run.model):
                run.model.save_pretrained(output_dir, state_dict=full_state)
            tokenizer.model_max_length = max_model_length(run.model.config)  # the model's limit, not this run's
            tokenizer.save_pretrained(output_dir)
            (output_dir / "train_results.json").write_text(json.dumps(results, indent=2))
            (output_dir / "trainer_state.json").write_text(json.dumps(
                trainer_state(args.max_steps, args.max_steps, log_history, args, accelerator.num_processes), indent=2))
        except Exception as error:  # noqa: BLE001  (safetensors raises SafetensorError, no OSError)
            if is_disk_full(error):
                raise disk_full_error(output_dir, "the final model", error) from error
            raise
    accelerator.wait_for_everyone()


def publish(args: PretrainArguments, repo_id: str | None, results: dict) -> None:
    """The model card, and the upload with --push_to_hub (main process, after end_training: no process waits at a
    barrier through a long upload)."""
    output_dir = Path(args.output_dir)
    write_pretraining_card(output_dir, args, repo_id or output_dir.resolve().name)
    if repo_id is not None:
        results["hub_commit"] = push_folder(
            output_dir, repo_id, token=args.hub_token, private=args.hub_private_repo,
            commit_message="Upload pretrained model, tokenizer and model card",
            ignore=(f"{CHECKPOINTS}/**", "pretrain/**"))  # resume state; accelerate trackers' logs


def run_pretraining(args: PretrainArguments) -> dict:
    """Pretrain as `args` say; returns the final metrics (also written to output_dir/train_results.json)."""
    accelerator = make_accelerator(args)
    repo_id = hub_repo_id(args, accelerator)  # token, Hub, repo name: before any data or model work
    config, objective, resume_from = check_run(args, accelerator)
    set_seed(args.seed)
    tokenizer, model, packed, validation_source, claim = prepare_model_and_data(args, accelerator, config,
                                                                                objective, resume_from)
    run = start_run(args, accelerator, model, tokenizer, packed, objective, claim)
    start_step, log_history = resume(args, accelerator, run, resume_from) if resume_from is not None else (0, [])
    if args.report_to != "none":
        accelerator.init_trackers("pretrain", config={k: v for k, v in asdict(args).items()
                                                      if isinstance(v, (int, float, str, bool))
                                                      and k not in SECRET_ARGUMENTS})
    world = accelerator.num_processes
    accelerator.print(f"{objective} pretraining of {type(model).__name__} "
                      f"({sum(p.numel() for p in model.parameters()):,} parameters) on {len(packed['train'])} rows "
                      f"of {args.max_seq_length} tokens, {world} process(es), mixed precision "
                      f"{accelerator.mixed_precision}")

    started = time.perf_counter()
    metrics = train(args, accelerator, run, tokenizer, objective, start_step, log_history)
    accelerator.wait_for_everyone()
    results = {**metrics, "objective": objective, "steps": args.max_steps, "validation": validation_source,
               "train_rows": len(packed["train"]), "num_processes": world,
               "mixed_precision": accelerator.mixed_precision,
               "seconds_this_session": round(time.perf_counter() - started, 1)}
    save_final_model(args, accelerator, run, tokenizer, results, log_history)
    run.release()
    accelerator.free_memory()
    accelerator.end_training()
    if accelerator.is_main_process:
        publish(args, repo_id, results)
    return results
