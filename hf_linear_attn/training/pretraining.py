"""Masked-LM (encoders) and causal-LM (decoders) pretraining with accelerate, resumable exactly.

Exactness on `--resume` rests on three choices:
- the data order is a permutation drawn from (seed, epoch), and a resumed run skips the batches already consumed
  (`accelerator.skip_first_batches`), so no sampler state has to survive;
- the masked-LM masks of each micro-batch come from a generator seeded by (seed, step, micro-batch, process), not
  from the global RNG, which the data loader's read-ahead would otherwise advance before a checkpoint is taken;
- model, optimizer, scheduler and the global RNGs (dropout) are saved by `accelerator.save_state` into a temporary
  folder that is renamed into place only when complete, so the newest checkpoint is never half written.
"""

import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, StackDataset, Subset
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    get_scheduler,
)
from transformers.modeling_outputs import MaskedLMOutput
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

import hf_linear_attn  # noqa: F401  (registers the package's models with the Auto classes)

from .errors import UsageError
from .data import load_text_corpus, pack_corpus, refuse_sources_inside, train_bpe_tokenizer

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
RUN_ARGS = "run_args.json"
# Arguments a resumed run may change; any other difference would make the continuation a different run.
RESUMABLE_CHANGES = {"resume", "resume_from_checkpoint", "overwrite_output_dir", "logging_steps", "report_to",
                     "save_total_limit", "eval_steps", "max_eval_samples"}


@dataclass
class PretrainArguments:
    """Arguments of scripts/pretrain.py (every field is a --flag; --config FILE.json gives defaults)."""

    output_dir: str = field(metadata={"help": "where the model, tokenizer, checkpoints and results go"})
    model_config: str | None = field(default=None, metadata={
        "help": "config of a new model: a JSON file (configs/models/...), a folder or a Hub id"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "continue from these weights instead"})
    objective: str = field(default="auto", metadata={
        "help": "mlm (encoders), clm (decoders) or auto (mlm for any model with a masked-LM head)",
        "choices": ["auto", "mlm", "clm"]})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset, e.g. Salesforce/wikitext"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "e.g. wikitext-2-raw-v1"})
    train_file: str | None = field(default=None, metadata={"help": "local text / json(l) / parquet training file"})
    validation_file: str | None = field(default=None, metadata={"help": "local validation file (same format)"})
    text_column: str = field(default="text")
    validation_split_percentage: float = field(default=5.0, metadata={
        "help": "percentage of train held out for validation when there is no validation split"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={
        "help": "tokenizer folder or Hub id; default: --model_name_or_path's, or (new models) a byte-level BPE "
                "trained on the corpus"})
    tokenizer_vocab_size: int = field(default=8000, metadata={"help": "vocabulary of a tokenizer trained here"})
    max_seq_length: int = field(default=128)
    mlm_probability: float = field(default=0.15)
    per_device_train_batch_size: int = field(default=16)
    per_device_eval_batch_size: int = field(default=16)
    gradient_accumulation_steps: int = field(default=1)
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    learning_rate: float = field(default=5e-4)
    weight_decay: float = field(default=0.01)
    adam_beta1: float = field(default=0.9)
    adam_beta2: float = field(default=0.98)
    adam_epsilon: float = field(default=1e-6)
    max_grad_norm: float = field(default=1.0)
    lr_scheduler_type: str = field(default="linear", metadata={"help": "a transformers schedule: linear, cosine, ..."})
    warmup_ratio: float = field(default=0.06)
    mixed_precision: str = field(default="auto", metadata={
        "help": "no, bf16, fp16, or auto (bf16 where the GPU / CPU has native bf16 arithmetic)",
        "choices": ["auto", "no", "bf16", "fp16"]})
    logging_steps: int = field(default=10)
    eval_steps: int = field(default=200, metadata={"help": "validation perplexity every N steps (and at the end)"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "validate on the first N packed rows"})
    save_steps: int = field(default=200, metadata={"help": "checkpoint every N steps"})
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept (the newest ones)"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint in output_dir"})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "continue from this checkpoint"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace what output_dir holds"})
    report_to: str = field(default="none", metadata={"help": "accelerate tracker: none, tensorboard, wandb, ..."})
    seed: int = field(default=42)
    trust_remote_code: bool = field(default=False)


def resolve_mixed_precision(choice: str) -> str:
    """'auto' -> bf16 where the hardware computes in bf16 natively (CUDA with bf16, CPUs with AVX512-BF16 / AMX)."""
    if choice != "auto":
        return choice
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "no"


def max_model_length(config) -> int:
    """The longest input the model's position table allows."""
    if hasattr(config, "max_sequence_length"):  # this package's encoders
        return config.max_sequence_length
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and config.model_type.startswith(("roberta", "xlm")):
        return config.max_position_embeddings - (config.pad_token_id or 0) - 1  # RoBERTa offsets positions
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def objective_for(config, requested: str) -> str:
    """mlm for models with a masked-LM head, else clm; a requested objective the model cannot do is an error."""
    masked = type(config) in AutoModelForMaskedLM._model_mapping
    causal = type(config) in AutoModelForCausalLM._model_mapping
    if requested == "auto":
        requested = "mlm" if masked else "clm"
    if (requested == "mlm" and not masked) or (requested == "clm" and not causal):
        raise UsageError(f"a {config.model_type} model has no {'masked' if requested == 'mlm' else 'causal'}-LM "
                            "head; choose the other --objective or another model")
    return requested


def check_tokenizer_fits(tokenizer, config, objective: str, new_model: bool) -> None:
    """Raise if the tokenizer's ids do not fit the model (vocabulary size, special ids, mask token)."""
    if objective == "mlm" and tokenizer.mask_token_id is None:
        raise UsageError("masked-LM pretraining needs a tokenizer with a mask token")
    if new_model:
        return
    if len(tokenizer) > config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                            f"{config.vocab_size} rows: use the model's own tokenizer")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ours, theirs = getattr(tokenizer, name), getattr(config, name, None)
        if ours is not None and theirs is not None and ours != theirs:
            raise UsageError(f"tokenizer {name} = {ours} but the model's config has {theirs}: use the model's "
                                "own tokenizer")


def checkpoints_in(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of an interrupted save are ignored)."""
    folder = output_dir / CHECKPOINTS
    found = [p for p in folder.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, keep: int) -> Path:
    """accelerate state (model, optimizer, scheduler, RNGs) + step into checkpoints/step_N, atomically."""
    final = output_dir / CHECKPOINTS / f"{STEP_PREFIX}{step:07d}"
    partial = output_dir / CHECKPOINTS / f".partial-{STEP_PREFIX}{step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial), safe_serialization=False)  # tied embeddings: safetensors refuses shared tensors
    if accelerator.is_main_process:
        (partial / "trainer_state.json").write_text(json.dumps({"step": step}))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_tree(partial)
        stale = final.with_name(f".stale-{final.name}")
        if final.exists():  # a run resumed from an older checkpoint reaches the steps it had saved before
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
        os.replace(partial, final)  # the rename is atomic: a crash leaves either no checkpoint or a whole one
        shutil.rmtree(stale, ignore_errors=True)
        for old in checkpoints_in(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _run_record(args: PretrainArguments, world_size: int) -> dict:
    """What defines a run: the arguments a resumed run must share, and the number of processes."""
    return {**{k: v for k, v in asdict(args).items() if k not in RESUMABLE_CHANGES}, "num_processes": world_size}


def check_output_dir(args: PretrainArguments, world_size: int) -> Path | None:
    """Check the output folder against this run (nothing is written); return the checkpoint to resume from."""
    output_dir = Path(args.output_dir)
    recorded = _run_record(args, world_size)
    run_file = output_dir / RUN_ARGS
    resume_from = None
    if args.resume or args.resume_from_checkpoint:
        if not run_file.is_file():
            raise UsageError(f"nothing to resume: {output_dir} holds no run ({RUN_ARGS} is missing)")
        previous = json.loads(run_file.read_text())
        changed = sorted(k for k in set(previous) | set(recorded) if previous.get(k) != recorded.get(k))
        if changed:
            raise UsageError(f"--resume with different arguments than the run in {output_dir}: "
                                + ", ".join(f"{k}: {previous.get(k)!r} -> {recorded.get(k)!r}" for k in changed))
        if args.resume_from_checkpoint:
            resume_from = Path(args.resume_from_checkpoint)
            if not (resume_from / "trainer_state.json").is_file():
                raise UsageError(f"{resume_from} is not a complete checkpoint (no trainer_state.json)")
        else:
            found = checkpoints_in(output_dir)
            if not found:
                raise UsageError(f"no complete checkpoint in {output_dir / CHECKPOINTS} to resume from; start "
                                    "again with --overwrite_output_dir")
            resume_from = found[-1]
        return resume_from
    if output_dir.exists() and any(output_dir.iterdir()) and not args.overwrite_output_dir:
        raise UsageError(f"{output_dir} is not empty (it holds another run): pass --resume to continue it, "
                            "--overwrite_output_dir to replace it, or choose another --output_dir")
    refuse_sources_inside(output_dir, {"--model_name_or_path": args.model_name_or_path,
                                       "--tokenizer_name_or_path": args.tokenizer_name_or_path,
                                       "--model_config": args.model_config, "--train_file": args.train_file,
                                       "--validation_file": args.validation_file})
    return None


def claim_output_dir(args: PretrainArguments, accelerator: Accelerator) -> None:
    """Start a new run in output_dir (emptied with --overwrite_output_dir) and record its arguments for --resume."""
    output_dir = Path(args.output_dir)
    recorded = _run_record(args, accelerator.num_processes)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if output_dir.exists() and any(output_dir.iterdir()):
            shutil.rmtree(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUN_ARGS).write_text(json.dumps(recorded, indent=2))
    accelerator.wait_for_everyone()


def load_tokenizer(args: PretrainArguments, accelerator: Accelerator, corpus, style: str, resuming: bool):
    """The given tokenizer, or (main process) a byte-level BPE trained on the corpus, saved into output_dir."""
    output_dir = Path(args.output_dir)
    if args.tokenizer_name_or_path is not None or args.model_name_or_path is not None:
        source = args.tokenizer_name_or_path or args.model_name_or_path  # existing weights: their own tokenizer
    else:
        source = str(output_dir)
        if not resuming and accelerator.is_main_process:
            tokenizer = train_bpe_tokenizer(corpus["train"]["text"], args.tokenizer_vocab_size, style,
                                            args.max_seq_length)
            tokenizer.save_pretrained(output_dir)
        accelerator.wait_for_everyone()
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot load a tokenizer from {source}: {error}") from error


def load_model_config(args: PretrainArguments):
    """The config of --model_config or --model_name_or_path (exactly one of them)."""
    if (args.model_config is None) == (args.model_name_or_path is None):
        raise UsageError("pass exactly one of --model_config (a new model) and --model_name_or_path (weights)")
    source = args.model_config or args.model_name_or_path
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot read a model config from {source}: {error}") from error


def build_model(args: PretrainArguments, config, tokenizer, objective: str):
    """A new model from --model_config (sized to the tokenizer) or the weights of --model_name_or_path."""
    source = args.model_config or args.model_name_or_path
    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    new_model = args.model_config is not None
    check_tokenizer_fits(tokenizer, config, objective, new_model)
    if new_model:
        # a new model takes the tokenizer's vocabulary and special ids
        config.vocab_size = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name) is not None:
                setattr(config, name, getattr(tokenizer, name))
    if args.max_seq_length > max_model_length(config):
        raise UsageError(f"--max_seq_length {args.max_seq_length} is longer than the model allows "
                            f"({max_model_length(config)} positions): lower it or give the config more positions")
    if new_model:
        return auto.from_config(config, trust_remote_code=args.trust_remote_code)
    try:
        return auto.from_pretrained(source, config=config, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot load {objective} weights from {source}: {error}") from error


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

    def forward(self, input_ids, labels, attention_mask=None):
        """input_ids, labels (batch, n) -> MaskedLMOutput with the loss only."""
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


def make_accelerator(args: PretrainArguments) -> Accelerator:
    """The run's Accelerator: mixed precision and trackers as `args` say."""
    # Without cpu=True accelerate treats several launched processes on a CPU-only machine as independent runs.
    on_cpu = not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))
    return Accelerator(cpu=on_cpu, mixed_precision=resolve_mixed_precision(args.mixed_precision),
                       log_with=None if args.report_to == "none" else args.report_to, project_dir=args.output_dir)


def prepare_model_and_data(args: PretrainArguments, accelerator: Accelerator, config, objective: str,
                           resume_from: Path | None):
    """(tokenizer, model, packed corpus, validation source): the inputs read first, and only then output_dir
    claimed; a run refused on the way leaves no folder behind that a rerun would take for another run."""
    with accelerator.main_process_first():
        corpus, validation_source = load_text_corpus(
            args.dataset_name, args.dataset_config_name, args.train_file, args.validation_file, args.text_column,
            args.validation_split_percentage, args.seed)
    if resume_from is None:  # the inputs are readable: only now is output_dir emptied and claimed
        claim_output_dir(args, accelerator)
    try:
        tokenizer = load_tokenizer(args, accelerator, corpus, "roberta" if objective == "mlm" else "gpt2",
                                   resuming=resume_from is not None)
        set_seed(args.seed)  # the same initial weights whatever the tokenizer training consumed
        model = build_model(args, config, tokenizer, objective)
        with accelerator.main_process_first():
            packed = pack_corpus(corpus, tokenizer, args.max_seq_length, objective)
    except UsageError:
        if resume_from is None and accelerator.is_main_process:
            shutil.rmtree(args.output_dir, ignore_errors=True)
        raise
    return tokenizer, model, packed, validation_source


def evaluation_rows(validation, tokenizer, args: PretrainArguments, objective: str) -> dict:
    """The validation batch every evaluation scores: for masked LM one fixed masking, the same for every
    evaluation and every model."""
    if args.max_eval_samples is not None:
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


def run_pretraining(args: PretrainArguments) -> dict:
    """Pretrain as `args` say; returns the final metrics (also written to output_dir/train_results.json)."""
    if args.gradient_accumulation_steps < 1 or args.max_steps < 1:
        raise UsageError("--gradient_accumulation_steps and --max_steps must be at least 1")
    accelerator = make_accelerator(args)
    config = load_model_config(args)
    objective = objective_for(config, args.objective)
    resume_from = check_output_dir(args, accelerator.num_processes)
    output_dir = Path(args.output_dir)
    set_seed(args.seed)
    tokenizer, model, packed, validation_source = prepare_model_and_data(args, accelerator, config, objective,
                                                                         resume_from)
    eval_rows = evaluation_rows(packed["validation"], tokenizer, args, objective)
    trained, optimizer, scheduler = prepare_training(args, accelerator, model, objective)
    stream_source = BatchStream(accelerator, packed["train"], args.per_device_train_batch_size, args.seed)
    world = accelerator.num_processes

    start_step = 0
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        start_step = json.loads((resume_from / "trainer_state.json").read_text())["step"]
        accelerator.print(f"resumed from {resume_from} at step {start_step}")
    if args.report_to != "none":
        accelerator.init_trackers("pretrain", config={k: v for k, v in asdict(args).items()
                                                      if isinstance(v, (int, float, str, bool))})
    accelerator.print(f"{objective} pretraining of {type(model).__name__} "
                      f"({sum(p.numel() for p in model.parameters()):,} parameters) on {len(packed['train'])} rows "
                      f"of {args.max_seq_length} tokens, {world} process(es), mixed precision "
                      f"{accelerator.mixed_precision}")

    stream = stream_source.start(start_step * args.gradient_accumulation_steps)
    progress = tqdm(total=args.max_steps, initial=start_step, disable=not accelerator.is_local_main_process,
                    desc="pretraining")
    model.train()
    metrics, started = {}, time.perf_counter()
    running_loss = torch.zeros((), device=accelerator.device)  # this process's loss x tokens since the last log
    running_items = 0  # tokens of every process since the last log
    for step in range(start_step, args.max_steps):
        micro = [next(stream) for _ in range(args.gradient_accumulation_steps)]
        if objective == "mlm":
            micro = [_mask(b, tokenizer, args, seed=args.seed * 1_000_003 + (step * len(micro) + i) * world
                           + accelerator.process_index) for i, b in enumerate(micro)]
        else:
            micro = [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in micro]
        loss_sum, items = optimizer_step(accelerator, trained, optimizer, scheduler, micro, objective,
                                         args.max_grad_norm)
        running_loss += loss_sum
        running_items += items
        progress.update(1)
        done = step + 1
        if done % args.logging_steps == 0 or done == args.max_steps:
            # reduced only here: no extra synchronisation in the steps between logs
            loss_sum = accelerator.reduce(running_loss, "sum").item()
            logs = {"loss": loss_sum / max(running_items, 1), "learning_rate": scheduler.get_last_lr()[0]}
            running_loss.zero_()
            running_items = 0
            progress.set_postfix(loss=f"{logs['loss']:.3f}")
            accelerator.log(logs, step=done)
        if done % args.eval_steps == 0 or done == args.max_steps:
            metrics = evaluate_perplexity(model, accelerator, eval_rows, args.per_device_eval_batch_size, objective)
            accelerator.log(metrics, step=done)
            if accelerator.is_main_process:
                progress.write(f"step {done}: validation loss {metrics['eval_loss']:.4f}, "
                               f"perplexity {metrics['perplexity']:.2f}")
        if done % args.save_steps == 0 and done != args.max_steps:
            save_checkpoint(accelerator, output_dir, done, args.save_total_limit)
    progress.close()

    accelerator.wait_for_everyone()
    results = {**metrics, "objective": objective, "steps": args.max_steps, "validation": validation_source,
               "train_rows": len(packed["train"]), "num_processes": world,
               "mixed_precision": accelerator.mixed_precision,
               "seconds_this_session": round(time.perf_counter() - started, 1)}
    if accelerator.is_main_process:
        model.save_pretrained(output_dir)  # the module inside `trained`, trained in place
        tokenizer.model_max_length = max_model_length(model.config)  # the model's limit, not this run's length
        tokenizer.save_pretrained(output_dir)
        (output_dir / "train_results.json").write_text(json.dumps(results, indent=2))
    accelerator.wait_for_everyone()
    # end_training destroys the process group: the DDP wrapper (its reducer holds the group) goes first. Freed after
    # the group, the reducer joined gloo threads that never ended: a 2-process run hung there at exit (seen once).
    trained = optimizer = scheduler = stream = stream_source = None
    accelerator.free_memory()
    accelerator.end_training()
    return results
