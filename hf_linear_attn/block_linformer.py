"""Causal block Linformer, layer 1: torch only, no transformers import.

Plain Linformer cannot be causal: each projected row E K mixes all n positions, so masking the n x k score matrix
still lets position t see tokens after t. This causal variant splits each sequence into blocks of ``b`` tokens:

* inside its own block, token t attends exactly (softmax over the keys of its block at positions <= t);
* every earlier block i, once complete, is summarised by the Linformer projection of its b keys and values into k
  rows, E K_i and F V_i with E, F of shape (k, b); token t also attends to the summaries of all completed blocks.

One softmax covers both sets of keys. Token t therefore sees exactly tokens <= t (causal by construction), at
cost O(b + k t / b) per token: O(n b + n^2 k / b) for a sequence, b / k times less than softmax attention and still
quadratic in n. A decoder keeps the k-row summaries of completed blocks plus the raw keys / values of the current
block, so its cache grows by k rows per b tokens instead of one row per token.

Blocks are counted from each row's first real token, so a left-padded row gives the same outputs as the row alone.
Tensors are (batch, heads, n, head_dim); projections are (P, k, b) with P = heads or 1 (shared by the heads).
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class BlockLinformerState(NamedTuple):
    """What a decoder keeps between steps: summaries of completed blocks and the current block's keys / values.

    summary_keys, summary_values (B, H, S, k, d): k-row summaries of block slots 0..S-1;
    summary_valid (B, S): whether slot s holds a completed block of that row;
    block_keys, block_values (B, H, b, d): the current (incomplete) block, valid in slots < block_fill;
    block_fill (B,): number of tokens in the current block.
    """

    summary_keys: torch.Tensor
    summary_values: torch.Tensor
    summary_valid: torch.Tensor
    block_keys: torch.Tensor
    block_values: torch.Tensor
    block_fill: torch.Tensor

    def index_select(self, index: torch.Tensor) -> "BlockLinformerState":
        """The state of the rows ``index`` (beam reordering, batch selection)."""
        return BlockLinformerState(*(t.index_select(0, index.to(t.device)) for t in self))

    def to(self, device) -> "BlockLinformerState":
        """The same state on ``device``."""
        return BlockLinformerState(*(t.to(device) for t in self))

    def num_cached_rows(self) -> int:
        """Key rows held per sequence and head: k per summary slot plus the current block."""
        return self.summary_keys.shape[2] * self.summary_keys.shape[3] + self.block_keys.shape[2]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the decoding state's block summaries for a model computing in ``dtype``: at least float32.

    A summary row mixes b keys; rounded to bf16 (8 bits of mantissa) its score error grows with the scores, and in
    a decoder every later token reads it (scripts/decode_precision.py measures the decoding error against float64
    both ways). The cost is the summaries' memory, doubled against bf16: k float32 rows per b tokens are 2 k / b of a
    bf16 key/value cache (half of it at the default k = 64, b = 256; a quarter with bf16 summaries).
    """
    return torch.promote_types(dtype, torch.float32)


def project_blocks(blocks: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """E @ each block: blocks (B, H, N, b, d), projection (P, k, b) with P in {1, H} -> (B, H, N, k, d)."""
    num_matrices, k, b = projection.shape
    return torch.matmul(projection.to(blocks.dtype).reshape(1, num_matrices, 1, k, b), blocks)


def real_token_offsets(key_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's first real token (B,), for a mask (B, n) whose True entries form one run per row."""
    n = key_mask.shape[-1]
    first = torch.where(key_mask, torch.arange(n, device=key_mask.device), n).amin(-1)
    return torch.where(first == n, 0, first)


def _roll_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """out[r, ..., i, :] = x[r, ..., (i + shift[r]) % n, :] for x (B, H, n, d) or (B, n)."""
    n = x.shape[-2] if x.dim() == 4 else x.shape[-1]
    index = (torch.arange(n, device=x.device)[None, :] + shift[:, None]) % n  # (B, n)
    if x.dim() == 2:
        return x.gather(1, index)
    return x.gather(2, index[:, None, :, None].expand(x.shape[0], x.shape[1], n, x.shape[-1]))


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis (at least float32) where ``visible``; a row with nothing visible gets finite weights.

    A finite fill value (not -inf) keeps fully masked rows (pad queries) free of NaN in the forward and backward.
    """
    dtype = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return scores.softmax(dim=-1)


_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@functools.lru_cache(maxsize=8)
def _summary_mask(blocks: int, b: int, proj_k: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Additive mask ((N - 1) b, (N - 1) k) for the queries of blocks 1..N-1: block j sees the summaries of blocks < j.

    Shared by every layer and call with the same shape (cached), so the only stored tensor quadratic in n is this
    one, (b k) / 2 times smaller than one layer's scores in the materialised form.
    """
    query_block = torch.arange(1, blocks, device=device).repeat_interleave(b)
    key_block = torch.arange(blocks - 1, device=device).repeat_interleave(proj_k)
    visible = key_block[None, :] < query_block[:, None]
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


class _BlockSummaryAttention(torch.autograd.Function):
    """One softmax over [summaries of earlier blocks, own block's keys <= t] from two flash-attention calls.

    Forward: the own block (causal, every block at once as a batch of b x b problems) and the summaries (queries of
    blocks 1..N-1 against the k-row summaries of blocks 0..N-2, block-causal mask) each give an output and a
    log-sum-exp; the merged output is their softmax-weighted mix. Backward: each part's flash backward, given the
    MERGED output and log-sum-exp, returns exactly that part's share of the gradients of the joint softmax (its
    probabilities are exp(s - lse) and the row term sum(dO * O) is the joint one), so dQ is their sum.
    q, k, v (B, H, N b, d) with pad keys / values zeroed; summary_keys, summary_values (B, H, N k, d).
    """

    @staticmethod
    def forward(ctx, q, k, v, summary_keys, summary_values, b, proj_k, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        batch, heads, length, d = q.shape
        blocks = length // b
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        local = [t.view(batch, heads * blocks, b, d) for t in (q, k, v)]
        out, lse = flash(*local, 0.0, True, scale=scale)
        out, lse = out.reshape(batch, heads, length, d), lse.reshape(batch, heads, length)
        mask, ctx.summary_shape = None, summary_keys.shape
        summary_keys = summary_keys[:, :, : (blocks - 1) * proj_k].contiguous()
        summary_values = summary_values[:, :, : (blocks - 1) * proj_k].contiguous()
        if blocks > 1:
            mask = _summary_mask(blocks, b, proj_k, q.dtype, str(q.device))
            later = q[:, :, b:].contiguous()
            out_s, lse_s = flash(later, summary_keys, summary_values, 0.0, False, attn_mask=mask, scale=scale)
            lse_l = lse[:, :, b:]
            merged = torch.logaddexp(lse_l, lse_s)
            mixed = (lse_l - merged).exp().unsqueeze(-1) * out[:, :, b:] + (lse_s - merged).exp().unsqueeze(-1) * out_s
            out = torch.cat([out[:, :, :b], mixed.to(q.dtype)], dim=2)
            lse = torch.cat([lse[:, :, :b], merged], dim=2)
        ctx.save_for_backward(q, k, v, summary_keys, summary_values, out, lse)
        ctx.mask, ctx.b, ctx.proj_k, ctx.scale = mask, b, proj_k, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, summary_keys, summary_values, out, lse = ctx.saved_tensors
        b, scale = ctx.b, ctx.scale
        batch, heads, length, d = q.shape
        blocks = length // b
        grad = grad.contiguous().to(q.dtype)
        local = [t.contiguous().view(batch, heads * blocks, b, d) for t in (grad, q, k, v, out)]
        lse_local = lse.contiguous().view(batch, heads * blocks, b)
        d_q, d_k, d_v = backward(*local, lse_local, 0.0, True, scale=scale)
        d_q, d_k, d_v = (t.reshape(batch, heads, length, d) for t in (d_q, d_k, d_v))
        d_sk = d_sv = q.new_zeros(ctx.summary_shape)  # one block: the summaries are seen by no query
        if blocks > 1:
            d_qs, d_sk, d_sv = backward(
                grad[:, :, b:].contiguous(), q[:, :, b:].contiguous(), summary_keys, summary_values,
                out[:, :, b:].contiguous(), lse[:, :, b:].contiguous(), 0.0, False, attn_mask=ctx.mask, scale=scale,
            )
            d_q = torch.cat([d_q[:, :, :b], d_q[:, :, b:] + d_qs], dim=2)
            d_sk, d_sv = (F.pad(t, (0, 0, 0, ctx.proj_k)) for t in (d_sk, d_sv))  # the last block's: seen by none
        return d_q, d_k, d_v, d_sk, d_sv, None, None, None


# The materialised form's scores per group of query blocks (float32 bytes): small enough that a group's scores,
# weights and dropout mask stay in the tens of MB at any n, large enough that a short sequence is one group.
_GROUP_SCORE_BYTES = 32 << 20


def _block_weights(q_b, k_b, summary_keys, local_mask, first: int, slots: int, proj_k: int, scale: float):
    """Softmax weights (B, H, g, b, slots k + b) of query blocks first..first+g-1 (q_b, k_b: (B, H, g, b, d)) over
    the first ``slots`` block summaries (summary_keys (B, H, >= slots k, d); block j sees those of blocks < j),
    then their own block's keys <= t that are real (local_mask (B, 1, g, 1, b))."""
    batch, _, g, b, _ = q_b.shape
    keys = summary_keys[:, :, : slots * proj_k]
    summary_scores = torch.matmul(q_b, keys.transpose(-1, -2).unsqueeze(2)) * scale  # (B, H, g, b, slots k)
    local_scores = torch.matmul(q_b, k_b.transpose(-1, -2)) * scale  # (B, H, g, b, b)
    query_block = torch.arange(first, first + g, device=q_b.device)
    summary_visible = (torch.arange(slots, device=q_b.device)[None, :] < query_block[:, None])  # (g, slots)
    summary_visible = summary_visible.repeat_interleave(proj_k, dim=-1)[None, None, :, None, :]
    local_visible = torch.ones(b, b, dtype=torch.bool, device=q_b.device).tril() & local_mask  # (B, 1, g, b, b)
    visible = torch.cat([summary_visible.expand(batch, 1, g, b, -1), local_visible], dim=-1)
    return _masked_softmax(torch.cat([summary_scores, local_scores], dim=-1), visible)


def _weighted_values(weights, summary_values, v_b, dropout: float) -> torch.Tensor:
    """(B, H, g, b, d): dropout on the weights, then their mix of the summaries' values and the own block's."""
    summary_columns = weights.shape[-1] - v_b.shape[-2]
    dropped = F.dropout(weights, p=dropout, training=dropout > 0).to(v_b.dtype)
    summary_part, local_part = dropped.split([summary_columns, v_b.shape[-2]], dim=-1)
    return torch.matmul(summary_part, summary_values[:, :, :summary_columns].unsqueeze(2)) + torch.matmul(local_part, v_b)


def _blocks_output(q_b, k_b, v_b, summary_keys, summary_values, local_mask, first, slots, proj_k, scale, dropout):
    """The output of one group of query blocks in the materialised form (the unit a checkpoint recomputes)."""
    weights = _block_weights(q_b, k_b, summary_keys, local_mask, first, slots, proj_k, scale)
    return _weighted_values(weights, summary_values, v_b, dropout)


def causal_block_linformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_projection: torch.Tensor,
    value_projection: torch.Tensor,
    block_size: int,
    key_mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    need_weights: bool = False,
    return_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, BlockLinformerState | None]:
    """Causal block Linformer over a whole sequence: q, k, v (B, H, n, d) -> output (B, H, n, d).

    ``key_mask`` (B, n) is True at real tokens, which must form one contiguous run per row (left or right padding).
    With ``need_weights`` also returns the weights (B, H, n, S k + b): per query, over the S = ceil(n / b) block
    summaries (k rows each, slot i = block i) followed by the b keys of the query's own block.
    With ``return_state`` also returns the :class:`BlockLinformerState` a decoder continues from.
    """
    batch, heads, n, head_dim = q.shape
    b = block_size
    proj_k = key_projection.shape[-2]
    if key_mask is None:
        key_mask = torch.ones(batch, n, dtype=torch.bool, device=q.device)
    shift = real_token_offsets(key_mask)
    shifted = bool(shift.any())
    if shifted:  # left-align every row: blocks then start at each row's first real token
        q, k, v, key_mask = (_roll_rows(t, shift) for t in (q, k, v, key_mask))
    keep = key_mask[:, None, :, None]
    k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    # The fused path masks keys by causality only: with padding, a pad query would also see the pad keys (zeroed)
    # and its output, unused but returned, would differ from the masked softmax's. Padded batches take that form.
    unpadded = bool(key_mask.all())

    num_blocks = -(-n // b)
    padded = num_blocks * b - n
    if padded:
        q, k, v = (F.pad(t, (0, 0, 0, padded)) for t in (q, k, v))
        key_mask = F.pad(key_mask, (0, padded))
    q_b, k_b, v_b = (t.reshape(batch, heads, num_blocks, b, head_dim) for t in (q, k, v))
    summary_keys = project_blocks(k_b, key_projection)  # (B, H, N, k, d)
    summary_values = project_blocks(v_b, value_projection)

    scale = head_dim**-0.5
    block_index = torch.arange(num_blocks, device=q.device)
    local_mask = key_mask.reshape(batch, 1, num_blocks, 1, b)  # real keys of each block
    if unpadded and not need_weights and dropout == 0.0 and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES:
        # Fused path: two flash-attention calls (the own block, causal; the summaries of earlier blocks, block-causal)
        # merged by their log-sum-exp into one softmax; nothing n x (S k) is stored, memory grows linearly in n.
        output = _BlockSummaryAttention.apply(
            q, k, v, summary_keys.flatten(2, 3), summary_values.flatten(2, 3), b, proj_k, scale
        )
    elif need_weights:
        weights = _block_weights(q_b, k_b, summary_keys.flatten(2, 3), local_mask, 0, num_blocks, proj_k, scale)
        # The maps returned (B, H, n, S k + b), in the caller's row order, are the very tensor the output is
        # computed from, so gradients of the output reach them (gradient-based attribution), as with GPT-2.
        returned = weights.reshape(batch, heads, num_blocks * b, -1)[:, :, :n]
        returned = _roll_rows(returned, -shift) if shifted else returned
        weights = _roll_rows(returned, shift) if shifted else returned
        weights = F.pad(weights, (0, 0, 0, padded)).reshape(batch, heads, num_blocks, b, -1)
        output = _weighted_values(weights, summary_values.flatten(2, 3), v_b, dropout)
    else:
        # Materialised form (attention dropout, padding, or no flash kernel for the device / dtype), in groups of
        # query blocks whose scores stay under _GROUP_SCORE_BYTES. Under autograd each group is recomputed in the
        # backward (checkpoint, which restores the RNG: the same dropout mask), so what is kept for the backward
        # grows linearly in n, as in the fused form, for about one more forward of the attention.
        per_block = batch * heads * b * (num_blocks * proj_k + b) * 4
        group = max(1, _GROUP_SCORE_BYTES // per_block)
        recompute = group < num_blocks and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v, key_projection, value_projection))
        keys, values = summary_keys.flatten(2, 3), summary_values.flatten(2, 3)
        parts = []
        for first in range(0, num_blocks, group):
            last = min(first + group, num_blocks)
            args = (q_b[:, :, first:last], k_b[:, :, first:last], v_b[:, :, first:last], keys, values,
                    local_mask[:, :, first:last], first, last - 1, proj_k, scale, dropout)
            parts.append(checkpoint(_blocks_output, *args, use_reentrant=False) if recompute else _blocks_output(*args))
        output = torch.cat(parts, dim=2)
    output = output.reshape(batch, heads, num_blocks * b, head_dim)[:, :, :n]

    state = None
    if return_state:
        lengths = key_mask.sum(-1)  # (B,) real tokens, now at the start of each row
        completed = lengths // b
        valid = block_index[None, :] < completed[:, None]
        current = completed.clamp(max=num_blocks - 1)[:, None, None, None, None]
        in_current = completed < num_blocks  # False: the last block is complete and the next one is empty
        pick = current.expand(batch, heads, 1, b, head_dim)
        block_keys = torch.where(in_current[:, None, None, None], k_b.gather(2, pick).squeeze(2), 0.0)
        block_values = torch.where(in_current[:, None, None, None], v_b.gather(2, pick).squeeze(2), 0.0)
        slots = int(completed.max())  # keep only slots some row has completed: k rows per completed block
        state_keys, state_values = summary_keys[:, :, :slots], summary_values[:, :, :slots]
        if summary_keys.dtype != state_dtype(summary_keys.dtype):  # bf16 / fp16: the state keeps float32 summaries
            state_keys, state_values = (
                project_blocks(t[:, :, :slots].to(state_dtype(t.dtype)), projection)
                for t, projection in ((k_b, key_projection), (v_b, value_projection)))
        state = BlockLinformerState(state_keys, state_values, valid[:, :slots], block_keys, block_values, lengths % b)

    if shifted:
        output = _roll_rows(output, -shift)
    return output, (returned if need_weights else None), state


def block_linformer_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: BlockLinformerState,
    key_projection: torch.Tensor,
    value_projection: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    grow: bool = True,
) -> tuple[torch.Tensor, BlockLinformerState]:
    """One decoding step: q, k, v (B, H, 1, d) of one new token per row -> output (B, H, 1, d), new state.

    The token joins the current block and attends to it and to the summaries of completed blocks; a block that
    becomes complete is projected into k rows and stored in the row's next summary slot. Rows where ``key_mask``
    (B,) is False hold a pad: their state is left unchanged (and their output is meaningless).

    ``grow``: the state adds a summary slot when a row completes more blocks than it has slots (a generation cache
    keeps only the slots in use). ``grow=False``: the state has a fixed capacity of slots (see
    :func:`empty_block_linformer_state`) and keeps its shapes, so that the step has no data-dependent branch under
    ``torch.compile`` / ``torch.export``: there every step projects the current block, used or not, and writes it
    where a row completes one; eager mode still skips that when no row completes a block, and raises when a row
    completes more blocks than the capacity.
    """
    batch, heads, _, head_dim = q.shape
    b = state.block_keys.shape[2]
    proj_k = state.summary_keys.shape[3]
    real = torch.ones(batch, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.reshape(batch)
    slot = (F.one_hot(state.block_fill, b).bool() & real[:, None])[:, None, :, None]  # (B, 1, b, 1)
    block_keys = torch.where(slot, k.to(state.block_keys.dtype), state.block_keys)
    block_values = torch.where(slot, v.to(state.block_values.dtype), state.block_values)
    fill = state.block_fill + real.long()

    # Scores and the weighted sum in at least float32, as the whole-sequence (flash) form computes them: in bf16
    # every product q_i k_i and w_j v_j would be rounded before the sum (flash accumulates exact products).
    compute = torch.promote_types(q.dtype, torch.float32)
    keys = torch.cat([state.summary_keys.flatten(2, 3).to(compute), block_keys.to(compute)], dim=2)
    values = torch.cat([state.summary_values.flatten(2, 3).to(compute), block_values.to(compute)], dim=2)
    visible = torch.cat(
        [
            state.summary_valid.repeat_interleave(proj_k, dim=-1),
            torch.arange(b, device=q.device)[None, :] < fill[:, None],
        ],
        dim=-1,
    )[:, None, None, :]
    # Broadcast products instead of matmuls: batched matmuls with a single query row hit slow paths on CPU.
    scores = (q.to(compute) * keys).sum(-1).unsqueeze(-2) * head_dim**-0.5  # (B, H, 1, rows)
    weights = _masked_softmax(scores, visible)
    output = (weights.to(compute).transpose(-1, -2) * values).sum(-2, keepdim=True).to(v.dtype)  # (B, H, 1, d)

    summary_keys, summary_values, valid = state.summary_keys, state.summary_values, state.summary_valid
    complete = fill == b
    # Traced with a fixed capacity: no value is read. A growing state keeps its value checks even under
    # torch.compile (a graph break there): without them a completed block could overwrite the last summary.
    traced = not grow and torch.compiler.is_compiling()
    if traced or bool(complete.any()):
        # In the summaries' precision (float32 for a bf16 model, see state_dtype): k rows that stand for b tokens
        new_keys = project_blocks(block_keys.unsqueeze(2).to(summary_keys.dtype), key_projection).squeeze(2)
        new_values = project_blocks(block_values.unsqueeze(2).to(summary_values.dtype), value_projection).squeeze(2)
        slot_index = valid.sum(-1)  # completed blocks so far = the next free slot of each row
        if not traced and int(torch.where(complete, slot_index, 0).max()) >= valid.shape[1]:
            if not grow:
                raise ValueError(
                    f"The block Linformer state holds {valid.shape[1]} block summaries, and this step completes one "
                    "more: size its capacity for the longest sequence (empty_block_linformer_state(..., capacity=...); "
                    "DecoderStateStep gives room for n_positions tokens)."
                )
            # first row to complete this block: add a slot
            summary_keys = F.pad(summary_keys, (0, 0, 0, 0, 0, 1))
            summary_values = F.pad(summary_values, (0, 0, 0, 0, 0, 1))
            valid = F.pad(valid, (0, 1))
        # Rows that complete nothing now may already fill every slot: clamp them (their write is masked out).
        write = F.one_hot(slot_index.clamp(max=valid.shape[1] - 1), valid.shape[1]).bool() & complete[:, None]
        write_rows = write[:, None, :, None, None]
        summary_keys = torch.where(write_rows, new_keys.unsqueeze(2).to(summary_keys.dtype), summary_keys)
        summary_values = torch.where(write_rows, new_values.unsqueeze(2).to(summary_values.dtype), summary_values)
        valid = valid | write
        fill = torch.where(complete, 0, fill)
    return output, BlockLinformerState(summary_keys, summary_values, valid, block_keys, block_values, fill)


def empty_block_linformer_state(
    batch: int, heads: int, head_dim: int, proj_k: int, block_size: int, dtype: torch.dtype, device, capacity: int = 0
) -> BlockLinformerState:
    """The state before any token: no summaries and an empty current block.

    ``capacity``: summary slots allocated ahead (all empty); 0 for a state that grows as blocks complete, at least
    ``max tokens // block_size`` for the fixed-shape steps of ``block_linformer_step(..., grow=False)``.
    Summaries are held in :func:`state_dtype` of ``dtype``, the current block in ``dtype`` (its raw keys / values).
    """
    return BlockLinformerState(
        torch.zeros(batch, heads, capacity, proj_k, head_dim, dtype=state_dtype(dtype), device=device),
        torch.zeros(batch, heads, capacity, proj_k, head_dim, dtype=state_dtype(dtype), device=device),
        torch.zeros(batch, capacity, dtype=torch.bool, device=device),
        torch.zeros(batch, heads, block_size, head_dim, dtype=dtype, device=device),
        torch.zeros(batch, heads, block_size, head_dim, dtype=dtype, device=device),
        torch.zeros(batch, dtype=torch.long, device=device),
    )
