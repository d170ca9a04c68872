"""Configuration of the Linformer encoder (Wang et al. 2020)."""

from huggingface_hub.dataclasses import strict

from .configuration_common import ENCODER_HEADS, build_auto_map, plain_value_errors
from .configuration_roberta_style import RobertaStyleConfig
from .linformer_projection import check_linformer_options


@plain_value_errors
@strict
class LinformerConfig(RobertaStyleConfig):
    r"""
    A RoBERTa-style encoder whose self-attention projects keys and values along the sequence from n to k rows:
    `softmax(Q (E K)^T / sqrt(d)) (F V)`. All RoBERTa fields are as in [`RobertaStyleConfig`]; in addition:

    Args:
        linformer_k (`int` or `list[int]`, defaults to 128): projected length k; one value for every layer, or one
            per layer as the paper allows (not with `linformer_sharing="layerwise"`). Each k is at most
            `max_sequence_length`.
        linformer_sharing (`str`, defaults to `"headwise"`): how E and F are shared, as in the paper:
            `"none"` (separate E and F for every head and layer: 2 x layers x heads matrices),
            `"headwise"` (one E and one F per layer, shared by its heads: 2 x layers),
            `"key-value"` (headwise and E = F: one per layer),
            `"layerwise"` (a single matrix for keys and values of every layer).
        linformer_init (`str`, defaults to `"xavier_uniform"`): init of E and F: `"xavier_uniform"` as the authors'
            fairseq code (gain 1/sqrt(2) on each k x n matrix), `"normal"` (N(0, initializer_range), as a later
            BERT-style re-init of every weight does), `"pooling"` (each of the k rows the mean of n / k
            consecutive positions, the paper's pooling projection as a learned E's starting point) or
            `"multiscale"` (k // 2 rows of single positions, then pooled windows of the rest).
        linformer_normalize_rows (`bool`, defaults to `False`): project with E - (row sum - 1) / m on the m real
            tokens of each example, so every row of E and F sums to 1 and each projected key / value is an affine
            combination of token keys / values (a constant sequence projects to itself). Not in the paper: free rows
            let short masked-LM pretraining drive F's row sums to ~0, which removes the sequence mean from the values
            (a document classifier then loses the bag of words at the <s> token; hf-linear-attn's projection report
            measures the row sums of a checkpoint).
        linformer_drop_unreached_rows (`bool`, defaults to `False`): with a `"pooling"` or `"multiscale"` init
            (`"multiscale"`: the first k // 2 rows single positions, the others pooled windows of the rest), leave
            out of the softmax every projected row whose window starts after an example's last real token. Not in
            the paper: a short input otherwise meets only the first columns of E, and the rows it does not reach
            become zero keys (free rows) or copies of its mean (rows summing to 1) that still take a share of
            every softmax. With `"multiscale"`, an input of up to k // 2 tokens is then attended exactly.
    """

    model_type = "linformer"

    linformer_k: int | list[int] = 128
    linformer_sharing: str = "headwise"
    linformer_init: str = "xavier_uniform"
    linformer_normalize_rows: bool = False
    linformer_drop_unreached_rows: bool = False

    default_auto_map = build_auto_map("linformer", "Linformer", ENCODER_HEADS)

    def k_for_layer(self, layer_idx: int) -> int:
        """The projected length k of layer ``layer_idx``."""
        return self.linformer_k if isinstance(self.linformer_k, int) else self.linformer_k[layer_idx]

    def validate_linformer(self):
        check_linformer_options(self.linformer_sharing, self.linformer_init, self.linformer_drop_unreached_rows)
        ks = [self.linformer_k] if isinstance(self.linformer_k, int) else list(self.linformer_k)
        if not isinstance(self.linformer_k, int) and len(ks) != self.num_hidden_layers:
            raise ValueError(
                f"linformer_k lists {len(ks)} values for {self.num_hidden_layers} layers; give one per layer or a single int."
            )
        if self.linformer_sharing == "layerwise" and len(set(ks)) > 1:
            raise ValueError(
                "linformer_sharing='layerwise' uses one matrix for every layer, so it needs a single k; "
                f"got {self.linformer_k}. Use one int, or sharing 'key-value' for a k per layer."
            )
        for k in ks:
            if not 1 <= k <= self.max_sequence_length:
                raise ValueError(
                    f"linformer_k={k} must be between 1 and the maximum sequence length {self.max_sequence_length} "
                    "(the position table's rows after the first position): lower k or raise max_position_embeddings."
                )
