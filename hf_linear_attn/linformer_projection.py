"""Linformer sequence projection (Wang et al. 2020), layer 1: torch only, no transformers import.

Keys and values of shape (batch, heads, n, d) are projected along the sequence to (batch, heads, k, d) by a
learned matrix E of shape (P, k, n_max), P = heads (no sharing) or 1 (shared by the heads). Inputs shorter than
n_max use the first n columns of E, as the authors' code does. Pad rows are zeroed before the projection (the
authors' code skips this, so outputs there depend on how much padding the batch has).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

LINFORMER_SHARING = ("none", "headwise", "key-value", "layerwise")
LINFORMER_INIT = ("xavier_uniform", "normal", "pooling", "multiscale")
# Inits whose rows each start at a known position (row_starts): only these can leave unreached rows out.
STRUCTURED_INITS = ("pooling", "multiscale")


class LinformerProjection(nn.Module):
    """A learned sequence projection E with ``weight`` of shape (num_matrices, k, max_length)."""

    def __init__(self, num_matrices: int, k: int, max_length: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_matrices, k, max_length))
        nn.init.uniform_(self.weight, -xavier_bound(k, max_length), xavier_bound(k, max_length))


def add_linformer_projections(attention: nn.Module, sharing: str, num_heads: int, k: int, max_length: int) -> None:
    """Give an attention module the E / F its sharing mode owns, as ``key_projection`` / ``value_projection``.

    "none": one matrix per head for each; "headwise": one each, shared by the heads; "key-value": ``key_projection``
    only, used for keys and values; "layerwise": none, the model's single shared matrix is used (see
    :func:`shared_linformer_projection`).
    """
    num_matrices = num_heads if sharing == "none" else 1
    if sharing in ("none", "headwise", "key-value"):
        attention.key_projection = LinformerProjection(num_matrices, k, max_length)
    if sharing in ("none", "headwise"):
        attention.value_projection = LinformerProjection(num_matrices, k, max_length)


def shared_linformer_projection(sharing: str, k: int, max_length: int) -> LinformerProjection | None:
    """The single matrix of layerwise sharing, owned by the model and used by every layer; None for other modes."""
    return LinformerProjection(1, k, max_length) if sharing == "layerwise" else None


def linformer_projection_weights(
    attention: nn.Module, sharing: str, shared_projection: nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (E, F) weights an attention module projects keys and values with, under its sharing mode."""
    if sharing == "layerwise":
        return shared_projection.weight, shared_projection.weight
    key_projection = attention.key_projection.weight
    value_projection = key_projection if sharing == "key-value" else attention.value_projection.weight
    return key_projection, value_projection


def check_linformer_options(sharing: str, init: str, drop_unreached_rows: bool = False) -> None:
    """Raise a ValueError naming an unknown sharing mode or init of a Linformer config, or unreached rows to drop
    without an init that says where each row starts."""
    if sharing not in LINFORMER_SHARING:
        raise ValueError(f"Unknown linformer_sharing {sharing!r}; choose one of {', '.join(LINFORMER_SHARING)}.")
    if init not in LINFORMER_INIT:
        raise ValueError(f"Unknown linformer_init {init!r}; choose one of {', '.join(LINFORMER_INIT)}.")
    if drop_unreached_rows and init not in STRUCTURED_INITS:
        raise ValueError(
            f"linformer_drop_unreached_rows needs rows that start at known positions: linformer_init "
            f"{' or '.join(map(repr, STRUCTURED_INITS))}, not {init!r} (whose rows mix every position)."
        )


def xavier_bound(k: int, max_length: int) -> float:
    """Uniform bound of fairseq's Linformer init: xavier_uniform with gain 1/sqrt(2) on a (k, n) matrix."""
    return math.sqrt(6.0 / (k + max_length)) / math.sqrt(2.0)


def pooling_matrix(k: int, max_length: int) -> torch.Tensor:
    """(k, max_length) mean pooling: row i averages the positions j with floor(j k / max_length) = i.

    The paper's Section 4 pooling projection, used as the starting point of a learned E / F. Unlike a random
    (zero-mean) E, it starts as an average of real tokens, so a model whose E has not been trained yet still sees a
    bag of its tokens rather than a random-signed mix of them.
    """
    window = (torch.arange(max_length) * k) // max_length
    matrix = (window[None, :] == torch.arange(k)[:, None]).float()
    return matrix / matrix.sum(-1, keepdim=True).clamp(min=1.0)


def multiscale_matrix(k: int, max_length: int) -> torch.Tensor:
    """(k, max_length): the first k // 2 rows single positions 0, 1, ..., the other rows the means of equal windows
    of the positions after them.

    A pooling start for converted checkpoints read at many lengths: an input of up to k // 2 tokens is projected
    exactly (with :func:`row_starts` leaving the rows it does not reach out of the softmax, the attention is then
    the source's softmax attention), and only longer inputs are compressed, their tail pooled.
    """
    exact = min(k // 2, max_length)
    if k - exact == 0 or max_length - exact == 0:
        return torch.eye(k, max_length)
    rest = pooling_matrix(k - exact, max_length - exact)
    return torch.block_diag(torch.eye(exact), rest)


def row_starts(init: str, k: int, max_length: int) -> list[int]:
    """The first position each of the k rows of a structured init (``pooling``, ``multiscale``) covers: plain ints,
    computed without torch (a model being loaded builds its modules on the meta device, where tensors hold no data).
    Row i of the pooling matrix covers the j with floor(j k / n) = i, so it starts at ceil(i n / k)."""
    exact = min(k // 2, max_length) if init == "multiscale" else 0
    pooled_rows, pooled_positions = k - exact, max_length - exact
    return list(range(exact)) + [exact + -(-i * pooled_positions // pooled_rows) for i in range(pooled_rows)]


def reached_rows(starts: torch.Tensor, key_mask: torch.Tensor | None, n: int) -> torch.Tensor:
    """(B or 1, k) whether each row starts inside each example's real tokens (right padding: the first m)."""
    lengths = torch.full((1,), n, device=starts.device) if key_mask is None else key_mask.sum(-1)
    starts = starts.to(lengths.device)[None, :]
    return (starts < lengths[:, None]) | (starts == 0)  # the first row always: an all-pad row still has a softmax


def project_sequence(
    x: torch.Tensor,
    projection: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    normalize_rows: bool = False,
) -> torch.Tensor:
    """E[..., :n] @ x: x (B, H, n, d), projection (P, k, n_max) with P in {1, H} -> (B, H, k, d).

    ``normalize_rows``: use E' = E - (E.sum(-1) - 1) / m on the m real tokens of each example instead of E, so every
    row of E' sums to 1 over them and each projected row is an affine combination of token rows (a constant sequence
    projects to itself). Computed as E x - shift * sum(x) without forming E'.
    """
    n, max_length = x.shape[-2], projection.shape[-1]
    if n > max_length:
        raise ValueError(
            f"Sequence length {n} exceeds the Linformer projection length {max_length}: E and F have one column "
            "per position. Truncate the input (tokenizer(..., truncation=True)) or extend the model's maximum length."
        )
    if key_mask is not None:
        x = torch.where(key_mask[:, None, :, None], x, 0.0)
    if projection.shape[0] == 1:
        # One matrix for every head: project the (B, n, H * d) layout the heads were split from. Free when x is
        # that split view, and E is never expanded to one copy per head (a (B, H, k, n) temporary).
        batch, heads, _, d = x.shape
        flat = x.transpose(1, 2).reshape(batch, n, heads * d)
        projected = torch.matmul(projection[0, :, :n].to(x.dtype), flat).view(batch, -1, heads, d).transpose(1, 2)
    else:
        projected = torch.matmul(projection[..., :n].to(x.dtype), x)
    if not normalize_rows:
        return projected
    return projected - _row_shift(projection[..., :n], key_mask).to(x.dtype) * x.sum(-2, keepdim=True)


def _row_shift(projection: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, P, k, 1): (row sum of E over each example's real tokens - 1) / their count."""
    if key_mask is None:  # every column is a real token, the same shift for every example
        return ((projection.sum(-1) - 1.0) / projection.shape[-1])[None, ..., None]
    mask = key_mask.to(projection.dtype)
    row_sums = torch.einsum("pkn,bn->bpk", projection, mask)
    return ((row_sums - 1.0) / mask.sum(-1).clamp(min=1.0)[:, None, None])[..., None]


def linformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_projection: torch.Tensor,
    value_projection: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    need_weights: bool = False,
    normalize_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(Q (E K)^T / sqrt(d)) (F V): q, k, v (B, H, n, d) -> output (B, H, n, d), weights (B, H, n, k) or None.

    No mask is needed after the projection: each of the k projected rows is a mix of real tokens only.
    """
    projected_k = project_sequence(k, key_projection, key_mask, normalize_rows)
    projected_v = project_sequence(v, value_projection, key_mask, normalize_rows)
    return projected_attention(q, projected_k, projected_v, dropout, need_weights)


def projected_attention(
    q: torch.Tensor,
    projected_k: torch.Tensor,
    projected_v: torch.Tensor,
    dropout: float = 0.0,
    need_weights: bool = False,
    row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(Q K_p^T / sqrt(d)) V_p on already projected keys / values (B, H, k, d): the second half of Linformer.
    ``row_mask`` (B or 1, k): the projected rows the softmax may use (:func:`reached_rows`); None: all."""
    mask = None if row_mask is None else row_mask[:, None, None, :]
    if not need_weights:
        return F.scaled_dot_product_attention(q, projected_k, projected_v, attn_mask=mask, dropout_p=dropout), None
    scores = torch.matmul(q, projected_k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    weights = scores.softmax(dim=-1)
    output = torch.matmul(F.dropout(weights, p=dropout, training=dropout > 0), projected_v)
    return output, weights
