"""Start from pretrained weights: RoBERTa- and BERT-layout encoders and GPT-2 checkpoints -> this package's models.

`convert` builds the target model from the source's own dimensions, copies every weight the two share (the
families keep RoBERTa's and GPT-2's parameter names, so the mapping is one to one; BERT's names map by a fixed
renaming, `BERT_NAMES`), leaves the new parts (Linformer E / F, feature maps) at the family's init, and returns a
`ConversionReport` of what was copied, what is new and how it was initialised, and what was dropped.
`extend_max_length` grows a model's maximum input length.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
import transformers
from transformers import AutoConfig, AutoTokenizer

from hf_linear_attn import MODEL_FAMILIES, FavorFeatureMap, HedgehogFeatureMap, LinformerProjection, family_of
from hf_linear_attn.sliding_window_attention import SlidingWindowFactor
from hf_linear_attn.training.checkpoints import file_problem
from hf_linear_attn.training.errors import UsageError

# target model_type -> the kind of checkpoints it is converted from (RoBERTa-family encoders, GPT-2 decoders)
TARGETS = {model_type: family.kind for model_type, family in MODEL_FAMILIES.items()}
SOURCE_TYPES = {"encoder": ("roberta", "xlm-roberta", "camembert", "bert"), "decoder": ("gpt2",)}
# Sources with BERT's layout: positions from row 0, two token types, weights under 'bert.' and 'cls.predictions.'.
# MiniLM checkpoints (all-MiniLM-L6-v2, ...) are saved as model_type "bert" and convert as BERT.
BERT_LAYOUT = ("bert",)
# BERT parameter name prefix -> this package's (RoBERTa's) name, by source head. BERT's sequence classifier reads
# the pooler (dense + tanh on [CLS]) then a linear layer; RoBERTa's head is the same dense + tanh on <s> then
# out_proj, so the pooler becomes classifier.dense and the linear layer classifier.out_proj: an exact match at
# evaluation (RoBERTa's head adds one dropout before the dense layer in training).
BERT_NAMES = {
    "base": {},
    "masked-lm": {"bert.": "roberta.", "cls.predictions.transform.dense.": "lm_head.dense.",
                  "cls.predictions.transform.LayerNorm.": "lm_head.layer_norm.",
                  "cls.predictions.decoder.": "lm_head.decoder.", "cls.predictions.bias": "lm_head.bias"},
    "sequence-classification": {"bert.pooler.dense.": "classifier.dense.", "bert.": "roberta.",
                                "classifier.": "classifier.out_proj."},
    "token-classification": {"bert.": "roberta."},
    "question-answering": {"bert.": "roberta."},
    "multiple-choice": {"bert.": "roberta."},
}
# Encoders whose layout does not map onto these models, and what to convert instead.
OTHER_LAYOUTS = {
    "albert": "ALBERT shares one set of layer weights across all layers and factorises its embeddings "
              "(embedding_size < hidden_size), so no weight maps one to one",
    "distilbert": "DistilBERT names its weights differently (transformer.layer.N.attention.q_lin, ...) and has no "
                  "token types; its teacher (e.g. bert-base-uncased) converts",
    "deberta": "DeBERTa's disentangled attention uses relative positions, which the converted models do not compute",
    "deberta-v2": "DeBERTa's disentangled attention uses relative positions, which the converted models do not compute",
    "electra": "ELECTRA's discriminator names its weights 'electra.*' and may project embeddings to another width",
}
ENCODER_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "initializer_range", "layer_norm_eps", "classifier_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
    "tie_word_embeddings", "id2label", "label2id", "problem_type",
)
DECODER_FIELDS = (
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "resid_pdrop",
    "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "id2label", "label2id", "problem_type",
)
# head name -> Auto class; the source's head is read from its architecture name
HEADS = {
    "masked-lm": transformers.AutoModelForMaskedLM,
    "causal-lm": transformers.AutoModelForCausalLM,
    "sequence-classification": transformers.AutoModelForSequenceClassification,
    "token-classification": transformers.AutoModelForTokenClassification,
    "question-answering": transformers.AutoModelForQuestionAnswering,
    "multiple-choice": transformers.AutoModelForMultipleChoice,
    "base": transformers.AutoModel,
}
ARCHITECTURE_SUFFIXES = {
    "ForMaskedLM": "masked-lm", "LMHeadModel": "causal-lm", "ForCausalLM": "causal-lm",
    "ForSequenceClassification": "sequence-classification", "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering", "ForMultipleChoice": "multiple-choice", "Model": "base",
}


@dataclass
class ConversionReport:
    """What `convert` did: copied, new (with the init used) and dropped weights, and the shapes involved."""

    source: str
    source_architecture: str
    target_architecture: str
    head: str
    copied: list[str] = field(default_factory=list)
    new: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    copied_parameters: int = 0
    new_parameters: int = 0
    extended_to: int | None = None
    distillation: dict | None = None

    def summary(self) -> str:
        """A few readable lines: counts, then every new and dropped weight."""
        lines = [
            f"{self.source} ({self.source_architecture}) -> {self.target_architecture} [{self.head}]",
            f"copied exactly: {len(self.copied)} tensors, {self.copied_parameters:,} parameters",
            f"new: {len(self.new)} tensors, {self.new_parameters:,} parameters",
        ]
        lines += [f"  new     {name}: {how}" for name, how in self.new.items()]
        lines += [f"  dropped {name}: {why}" for name, why in self.dropped.items()]
        return "\n".join(lines)

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / "conversion_report.json"
        path.write_text(json.dumps(asdict(self), indent=2))
        return path


def _source_head(architecture: str, head: str) -> str:
    if head != "auto":
        if head not in HEADS:
            raise UsageError(f"Unknown head {head!r}; choose auto or one of {', '.join(HEADS)}.")
        return head
    for suffix, name in ARCHITECTURE_SUFFIXES.items():
        if architecture.endswith(suffix):
            return name
    raise UsageError(f"Cannot tell the head of architecture {architecture!r}; pass head= (e.g. 'base').")


def _targets(kind: str) -> str:
    return ", ".join(target for target, target_kind in TARGETS.items() if target_kind == kind)


def check_source(config, target: str) -> None:
    """Refuse a source config whose architecture `target` cannot reproduce, naming the difference and the fix.

    Reads only the config, so it runs before any weight is loaded.
    """
    check_target(target)
    family = TARGETS[target]
    if config.model_type not in SOURCE_TYPES[family]:
        expected = " / ".join(SOURCE_TYPES[family])
        why = OTHER_LAYOUTS.get(config.model_type)
        raise UsageError(
            f"Cannot convert a {config.model_type!r} checkpoint to {target!r}: {target} is converted from "
            f"{expected} checkpoints (same layer layout and parameter names). "
            + (f"{why}. " if why else "")
            + f"Convert a checkpoint of a supported layout instead. Targets by source: encoders "
            f"({', '.join(SOURCE_TYPES['encoder'])}) -> {_targets('encoder')}; gpt2 -> {_targets('decoder')}."
        )
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise UsageError(
            f"The source uses relative position embeddings (position_embedding_type={position_type!r}); the "
            "converted encoders learn absolute positions only, so its relative-distance weights would be dropped and "
            "every attention score would change. Convert a checkpoint with position_embedding_type='absolute'."
        )
    _check_source(config, family, target)


def _check_source(config, family: str, target: str) -> None:
    unsupported = {
        "is_decoder": (False, getattr(config, "is_decoder", False)),
        "add_cross_attention": (False, getattr(config, "add_cross_attention", False)),
        "scale_attn_weights": (True, getattr(config, "scale_attn_weights", True)),
        "scale_attn_by_inverse_layer_idx": (False, getattr(config, "scale_attn_by_inverse_layer_idx", False)),
    }
    for name, (wanted, got) in unsupported.items():
        if got != wanted:
            raise UsageError(f"The source sets {name}={got!r}; the converted models support only {wanted!r}.")


def check_target(target: str) -> None:
    """Refuse a target model_type this module does not convert to."""
    if target not in TARGETS:
        raise UsageError(f"Unknown target {target!r}; choose one of {', '.join(TARGETS)}.")


def target_config(source_config, target: str, **options):
    """The target family's config with the source's dimensions and special tokens, plus family `options`."""
    check_source(source_config, target)
    family = TARGETS[target]
    fields = ENCODER_FIELDS if family == "encoder" else DECODER_FIELDS
    values = {name: getattr(source_config, name) for name in fields if hasattr(source_config, name)}
    if source_config.model_type in BERT_LAYOUT:  # positions from row 0; no <s> / </s> (BERT's [CLS] / [SEP])
        values.update(position_offset=0, bos_token_id=getattr(source_config, "bos_token_id", None),
                      eos_token_id=getattr(source_config, "eos_token_id", None))
    try:
        return AutoConfig.for_model(target, **values, **options)
    except (TypeError, ValueError, StrictDataclassClassValidationError) as error:  # an unknown or invalid option
        raise UsageError(f"Invalid options for {target}: {error}") from error


def _describe_init(module, config, name: str) -> str:
    if isinstance(module, LinformerProjection):
        return f"Linformer projection E/F, {config.linformer_init} init (config.linformer_init)"
    if isinstance(module, HedgehogFeatureMap):
        return "hedgehog feature map, identity init: phi(x) = [softmax(x), softmax(-x)] per head"
    if isinstance(module, FavorFeatureMap):
        return "FAVOR+ random features, an orthogonal Gaussian draw"
    if isinstance(module, SlidingWindowFactor):
        return (f"window factor g = exp(theta), theta = {module.init:g}" + (": the window's exact terms unweighted"
                                                                              if module.init == 0 else ""))
    if ".gk_proj." in f".{name}":
        return "GLA gate projection (low rank): weights normal (config.initializer_range), bias 0"
    return f"new {type(module).__name__} ({name.rsplit('.', 1)[-1]}), the model's own init"


def load_source_config(name: str):
    """The source's config, or an error naming the path."""
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise UsageError(f"Cannot read a model config from {name!r}: {error}") from error


def load_source(name: str, head: str = "auto", target: str | None = None):
    """(source model with eager attention, missing head weights): a RoBERTa / BERT-layout / GPT-2 checkpoint by `head`.

    With `target`, the source's layout is checked against it from the config alone, before any weight is read.
    A checkpoint that lacks weights of the model body is refused; head weights it lacks (a masked-LM checkpoint
    loaded with a classification head) are returned so the conversion reports them as new, not as copied.
    """
    config = load_source_config(name)
    if target is not None:
        check_source(config, target)
    head = _source_head((config.architectures or ["?"])[0], head)
    auto = HEADS[head]
    if type(config) not in auto._model_mapping:
        raise UsageError(f"The source {name!r} ({config.model_type}) has no {head} head in transformers.")
    if Path(name).is_dir():  # a damaged weights file: say which and why, not safetensors' header message
        for weights in sorted(Path(name).glob("*.safetensors")):
            problem = file_problem(weights)
            if problem is not None:
                raise UsageError(f"Cannot load the weights of {name!r}: {weights.name} is {problem}; save or "
                                 "download the checkpoint again.")
    try:
        model, info = auto.from_pretrained(name, output_loading_info=True, attn_implementation="eager")
    except Exception as error:  # OSError, ValueError, RuntimeError, safetensors' SafetensorError, pickle errors
        raise UsageError(f"Cannot load the weights of {name!r}: {type(error).__name__}: {error}") from error
    mismatched = {k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys", [])}
    missing = sorted(set(info.get("missing_keys", [])) | mismatched)
    body = [key for key in missing if key.startswith(model.base_model_prefix + ".")]
    if body:
        raise UsageError(
            f"The checkpoint {name!r} lacks weights its architecture needs: {', '.join(body[:8])}"
            + (f" (and {len(body) - 8} more)" if len(body) > 8 else "")
            + ". It is incomplete or of another architecture; converting it would start those weights at random."
        )
    return model, missing


def convert(source, target: str, head: str = "auto", not_in_checkpoint=(), **options):
    """(target model, ConversionReport): `source` (Hub id, folder or a loaded model) rebuilt as `target`.

    Every weight the two architectures share is copied exactly; options (linformer_k, feature_map, ...) go to
    the target config. A checkpoint that lacks weights of its model body is refused, not silently re-drawn.
    `not_in_checkpoint`: for a model loaded with `load_source`, the head weights it drew at random (its second
    value), reported as new rather than copied.
    """
    check_target(target)
    missing = list(not_in_checkpoint)
    if isinstance(source, (str, Path)):
        source, missing = load_source(str(source), head, target)
    head = _source_head(type(source).__name__, head)
    config = target_config(source.config, target, **options)
    if head not in _heads_of(config):
        raise UsageError(f"{target} has no {head} head; choose one of {', '.join(_heads_of(config))}.")
    if head == "masked-lm" and source.config.model_type in BERT_LAYOUT and source.config.hidden_act != "gelu":
        raise UsageError(  # RoBERTa's masked-LM head, which the targets keep, applies gelu whatever hidden_act says
            f"The source's hidden_act is {source.config.hidden_act!r}, which BERT's masked-LM head applies and the "
            "converted head (RoBERTa's, gelu) does not; convert another head (e.g. --head base) or a gelu checkpoint.")
    model = HEADS[head].from_config(config)
    report = copy_shared_weights(source, model, not_in_checkpoint=set(missing))
    report.source, report.head = getattr(source, "name_or_path", "") or "<model>", head
    model.config.architectures = [type(model).__name__]
    return model, report


def _heads_of(config) -> list[str]:
    return [name for name, auto in HEADS.items() if type(config) in auto._model_mapping]


@torch.no_grad()
def copy_shared_weights(source_model, model, not_in_checkpoint=frozenset()) -> ConversionReport:
    """Copy every tensor whose name the two models share (shapes must agree); report copied / new / dropped.

    `not_in_checkpoint`: source tensors that were drawn at load time, not read from the checkpoint (never copied).
    """
    source_state = {k: v for k, v in source_model.state_dict().items() if k not in not_in_checkpoint}
    source_buffers = {name for name, _ in source_model.named_buffers()}
    if getattr(source_model.config, "model_type", None) in BERT_LAYOUT:
        renames = BERT_NAMES[_source_head(type(source_model).__name__, "auto")]
        source_state = {_rename(k, renames): v for k, v in source_state.items()}
        source_buffers = {_rename(k, renames) for k in source_buffers}
    report = ConversionReport(source="", source_architecture=type(source_model).__name__,
                              target_architecture=type(model).__name__, head="")
    state = model.state_dict()
    mismatched = [f"{name} {tuple(source_state[name].shape)} -> {tuple(t.shape)}" for name, t in state.items()
                  if name in source_state and source_state[name].shape != t.shape]
    if mismatched:
        raise UsageError("Shapes differ between source and target for: " + "; ".join(mismatched[:8]))
    for name, tensor in state.items():
        if name in source_state:
            tensor.copy_(source_state[name])
            report.copied.append(name)
        else:
            report.new[name] = _describe_init(model.get_submodule(name.rpartition(".")[0]), model.config, name)
    parameters = dict(model.named_parameters())  # tied weights once
    report.copied_parameters = sum(p.numel() for name, p in parameters.items() if name not in report.new)
    report.new_parameters = sum(p.numel() for name, p in parameters.items() if name in report.new)
    base = model.base_model_prefix + "."
    for name in source_state:
        if name in state:
            continue
        if name in source_buffers:
            report.dropped[name] = "buffer the target does not use (recomputed, not learned)"
        elif name.startswith(base):
            raise UsageError(
                f"The source has a learned weight the target cannot hold: {name}. The architectures differ; "
                "only checkpoints with the stock RoBERTa / BERT / GPT-2 layer layout convert."
            )
        else:
            report.dropped[name] = "head weight not in the target head (choose head= to keep it)"
    return report


def _rename(name: str, renames: dict[str, str]) -> str:
    """`name` with its first matching prefix replaced (BERT_NAMES lists the longer prefixes first)."""
    for old, new in renames.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def save_converted(model, report: ConversionReport, output_dir: str | Path, tokenizer=None) -> Path:
    """save_pretrained (weights, config, model code) + tokenizer + conversion_report.json."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    report.save(output_dir)
    return output_dir


# Files that hold a tokenizer's vocabulary (fast, WordPiece, BPE, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "sentencepiece.bpe.model", "spiece.model",
                   "tokenizer.model")


def load_source_tokenizer(source: str):
    """The source's tokenizer, or None when the source has none.

    transformers 5 builds a tokenizer of special tokens alone from a folder holding only a config (every word
    becomes [UNK]); that is no tokenizer, so a folder without a vocabulary file, or a tokenizer with no ordinary
    token, counts as none.
    """
    if Path(source).is_dir() and not any((Path(source) / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError):
        return None
    return tokenizer if len(tokenizer) > len(set(tokenizer.all_special_tokens)) else None


# --------------------------------------------------------------------------------------------- length extension


@torch.no_grad()
def extend_max_length(model, new_max_length: int):
    """A copy of a RoBERTa-style model (Linformer or linear attention) that takes inputs up to `new_max_length`.

    Position table: the learned rows are tiled (position p >= the old maximum starts as position p mod old
    maximum), as Longformer grew RoBERTa. Linformer E / F (k x n_max): stretched, column j of the new matrix is
    column floor(j * old / new) of the old one times old / new, so each of the k projected rows still averages the
    same fraction of the sequence (a sequence whose tokens are each repeated r times projects exactly as the
    original; inputs shorter than the old maximum now see different columns). Both are starting points: fine-tune
    at the new length before relying on it.
    """
    config = model.config
    if getattr(family_of(model), "kind", None) != "encoder":
        raise UsageError(
            f"extend_max_length handles this package's encoders ({_targets('encoder')}), not "
            f"{getattr(config, 'model_type', type(model).__name__)!r}."
        )
    if getattr(config, "linformer_drop_unreached_rows", False):
        raise UsageError(
            "extend_max_length stretches E / F, which moves where each row starts, and linformer_drop_unreached_rows "
            "reads those starts from the init: convert without --linformer_drop_unreached_rows to extend."
        )
    old = config.max_sequence_length
    if new_max_length <= old:
        raise UsageError(f"new_max_length ({new_max_length}) must exceed the current maximum ({old}).")
    offset = config.max_position_embeddings - old  # rows below the first position (RoBERTa's pad index; none for BERT)
    new_config = config.__class__.from_dict({**config.to_dict(), "max_position_embeddings": new_max_length + offset})
    new_model = type(model)(new_config)
    state = model.state_dict()
    new_state = {}
    scale = old / new_max_length
    source_columns = torch.div(torch.arange(new_max_length) * old, new_max_length, rounding_mode="floor")
    for name, tensor in new_model.state_dict().items():
        value = state[name]
        if name.endswith("embeddings.position_embeddings.weight"):
            positions = torch.arange(new_max_length) % old
            value = torch.cat([value[:offset], value[offset:][positions]])
        elif isinstance(new_model.get_submodule(name.rpartition(".")[0]), LinformerProjection):
            value = value[..., source_columns] * scale
        elif value.shape != tensor.shape:  # buffers sized by the position table (position_ids, token_type_ids)
            value = tensor
        new_state[name] = value
    new_model.load_state_dict(new_state)
    return new_model.train(model.training)

