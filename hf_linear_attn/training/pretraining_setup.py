"""What a pretraining run reads before its first step: the model config and objective, the tokenizer (given, or a
byte-level BPE trained on the corpus), the model (new or from weights) and the packed corpus, with output_dir claimed
only once the inputs are readable."""

import copy
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from hf_linear_attn.families import max_model_length

from .data.corpus import load_text_corpus, pack_corpus, train_bpe_tokenizer
from .errors import UsageError
from .fsdp import check_wrap_classes
from .pretraining_arguments import PretrainArguments
from .run_state import claim_output_dir, release_output_dir
from .sources import check_model_source, check_tokenizer_source


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


def load_model_config(args: PretrainArguments):
    """The config of --model_config or --model_name_or_path (exactly one of them)."""
    if (args.model_config is None) == (args.model_name_or_path is None):
        raise UsageError("pass exactly one of --model_config (a new model) and --model_name_or_path (weights)")
    source = args.model_config or args.model_name_or_path
    check_model_source(source, "--model_config" if args.model_config else "--model_name_or_path")
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise UsageError(f"cannot read a model config from {source}: {error}") from error


def load_tokenizer(args: PretrainArguments, accelerator: Accelerator, corpus, style: str, resuming: bool):
    """The given tokenizer, or (main process) a byte-level BPE trained on the corpus, saved into output_dir."""
    output_dir = Path(args.output_dir)
    if args.tokenizer_name_or_path is not None or args.model_name_or_path is not None:
        source = args.tokenizer_name_or_path or args.model_name_or_path  # existing weights: their own tokenizer
        check_tokenizer_source(source, "--tokenizer_name_or_path" if args.tokenizer_name_or_path
                               else "--model_name_or_path (its tokenizer; or pass --tokenizer_name_or_path)")
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


def check_fsdp_wrapping(accelerator: Accelerator, config, objective: str, args: PretrainArguments) -> None:
    """Under FSDP, the accelerate config's layer classes checked against a weightless (meta-device) copy of the
    model, before any data is read or anything written."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(copy.deepcopy(config), trust_remote_code=args.trust_remote_code)
    check_wrap_classes(accelerator, skeleton)


def prepare_model_and_data(args: PretrainArguments, accelerator: Accelerator, config, objective: str,
                           resume_from: Path | None, claim: dict | None = None):
    """(tokenizer, model, packed corpus, validation source, claim): the inputs read first, and only then output_dir
    claimed (`claim_output_dir`); a run refused later is to `release_output_dir` the claim."""
    with accelerator.main_process_first():
        corpus, validation_source = load_text_corpus(
            args.dataset_name, args.dataset_config_name, args.train_file, args.validation_file, args.text_column,
            args.validation_split_percentage, args.seed)
    if resume_from is None:  # the inputs are readable: only now is output_dir claimed
        claim = claim_output_dir(args, accelerator)
    try:
        tokenizer = load_tokenizer(args, accelerator, corpus, "roberta" if objective == "mlm" else "gpt2",
                                   resuming=resume_from is not None)
        set_seed(args.seed)  # the same initial weights whatever the tokenizer training consumed
        model = build_model(args, config, tokenizer, objective)
        with accelerator.main_process_first():
            packed = pack_corpus(corpus, tokenizer, args.max_seq_length, objective)
    except Exception:  # a refusal, or any other failure before training: the folder as it was found
        if claim is not None:
            release_output_dir(args, accelerator, claim)
        raise
    return tokenizer, model, packed, validation_source, claim
