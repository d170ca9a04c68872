"""What every configuration of this package shares: the dropout and size checks, plain ValueErrors from every
check, and the ``auto_map`` of a family (:class:`FamilyConfig`, the base of both style configs)."""

import contextlib
import functools

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import PreTrainedConfig

# Auto class -> class-name suffix of every head a family ships, for the encoders and for the decoders.
ENCODER_HEADS = {
    "AutoModel": "Model",
    "AutoModelForMaskedLM": "ForMaskedLM",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
    "AutoModelForTokenClassification": "ForTokenClassification",
    "AutoModelForQuestionAnswering": "ForQuestionAnswering",
    "AutoModelForMultipleChoice": "ForMultipleChoice",
}
DECODER_HEADS = {
    "AutoModel": "Model",
    "AutoModelForCausalLM": "ForCausalLM",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
}


# A hybrid schedule's layer kinds, named as Transformers' hybrid models name them (Qwen3-Next: linear_attention /
# full_attention).
LAYER_TYPES = ("linear_attention", "full_attention")


def check_layer_types(layer_types, n_layer: int, n_layer_name: str = "n_layer") -> None:
    """Raise a ValueError naming the fix for a hybrid schedule (both linear families): one known kind per layer;
    ``n_layer_name`` is the config's name for its number of layers."""
    if layer_types is None:
        return
    if len(layer_types) != n_layer:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries for {n_layer_name}={n_layer}: give one kind per layer "
            f"({' / '.join(LAYER_TYPES)}), or None for every layer linear."
        )
    for i, kind in enumerate(layer_types):
        if kind == "sliding_attention":
            raise ValueError(
                f"layer_types[{i}] = 'sliding_attention': a pure sliding-window softmax layer is not implemented; "
                "use 'linear_attention' with attention_window=W (exact softmax over the last W keys, linear attention "
                "beyond), or 'full_attention'."
            )
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] = {kind!r} is not a layer kind; choose one of {', '.join(LAYER_TYPES)}.")


def check_dropouts(config, names) -> None:
    """Raise a ValueError naming a dropout probability outside [0, 1)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"{name} must be a probability in [0, 1), got {value}.")


def check_positive(config, names) -> None:
    """Raise a ValueError naming a size that is not a positive integer."""
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}.")


@contextlib.contextmanager
def _plain_value_errors():
    """A failed check raises its own ValueError, as documented, not the dataclass library's wrapper (no ValueError)."""
    try:
        yield
    except StrictDataclassClassValidationError as error:
        raise ValueError(str(error.__cause__ or error)) from error.__cause__


def validate_config(config) -> None:
    """Run every check of ``config`` (again): a value assigned after construction (``config.linformer_k = 0``) is
    caught where a model is built from it. Raises the failing check's own ValueError."""
    with _plain_value_errors():
        config.validate()


def plain_value_errors(cls):
    """Class decorator, above ``@strict``: building a config whose checks fail raises their ValueError."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        with _plain_value_errors():
            init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def build_auto_map(model_type: str, class_prefix: str, heads: dict[str, str]) -> dict[str, str]:
    """Every Auto class a checkpoint of a family opens with (``trust_remote_code``): the config and each head.

    ``build_auto_map("linformer", "Linformer", ENCODER_HEADS)`` maps AutoConfig to
    ``configuration_linformer.LinformerConfig`` and AutoModel to ``modeling_linformer.LinformerModel``, and so on:
    save_pretrained itself writes only the saved class's own Auto class.
    """
    auto_map = {"AutoConfig": f"configuration_{model_type}.{class_prefix}Config"}
    auto_map.update({auto: f"modeling_{model_type}.{class_prefix}{suffix}" for auto, suffix in heads.items()})
    return auto_map


@strict
class FamilyConfig(PreTrainedConfig):
    """The fields and defaults both style configs (RoBERTa's, GPT-2's) share: no cross-attention, tied word embeddings
    (declared: transformers 5 skips tying without it) and the ``auto_map`` every checkpoint of a family carries."""

    add_cross_attention: bool = False
    tie_word_embeddings: bool = True
    auto_map: dict | None = None

    # Filled in by each family: every Auto class a checkpoint of this family opens with (trust_remote_code).
    default_auto_map = {}

    def __post_init__(self, **kwargs):
        if self.auto_map is None:
            self.auto_map = dict(self.default_auto_map)
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        """hidden_size // num_attention_heads (GPT-2's n_embd // n_head, through its attribute_map)."""
        heads = self.attribute_map.get("num_attention_heads", "num_attention_heads")  # the field's own name
        check_positive(self, (heads,))  # read by transformers' own checks before ours
        return self.hidden_size // self.num_attention_heads
