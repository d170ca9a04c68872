"""How many associations a linear attention state holds when nothing else must be learned (issue 42, item 4: does a
decoder that falls short on MQAR lack state capacity or training budget?).

A decoder trained on MQAR must learn three things: to bring each key to its value's position (the short
convolution's previous-token shift does this), to write (phi(k), v) into its state, and to read the state back with
the queried key. This probe keeps only the last two. Each pair arrives as (key token, value token) side by side. One
layer writes them into the state a linear_gpt2 layer keeps: per head S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j),
through the library's `bidirectional_linear_attention`. Every key is then read back as a query. The model holds only
embeddings of the key and value tokens, the q / k / v projections into `heads` heads of `head_size`, and a linear
read-out to the value tokens. Pairings are fresh and random at every step, over all of the task's key and value
tokens, as in MQAR. So the accuracy reached measures how many arbitrary associations a state of this size and form
holds once the optimiser has converged, which takes minutes here instead of hours.

It is an estimate, not a proof of an upper bound: a decoder's MLPs and second layer could in principle build keys
the probe's embeddings cannot. The table therefore also gives the probe twice the heads, i.e. both layers' states
pooled in one layer.

Memories (`MEMORIES`):
- "elu": linear_gpt2's own read, phi = elu + 1 and the normaliser, y = phi(q) S / (phi(q) . z + eps).
- "elu_unnormalized": the same features without the normaliser, y = phi(q) S (RetNet and GLA read their states
  without one, and normalise the layer's output instead).
- "identity": no feature map and no normaliser, y = q S with S = sum_j k_j v_j^T: the classical linear associative
  memory, with signed keys.
- "hedgehog": Hedgehog's learned features (Zhang et al. 2024; linear_gpt2_hedgehog's map), phi(x) = [softmax(x W_h),
  softmax(-x W_h)] with W_h (head_size x head_size) per head, normalised as "elu": 2 x head_size features, so twice
  elu + 1's state.
- "hedgehog_narrow": the same with W_h of head_size / 2 columns: head_size features, elu + 1's state to the byte
  (linear_gpt2_hedgehog_narrow's map).
- "delta": the delta rule (DeltaNet; linear_gpt2's ``state_update="delta"``): q and k through SiLU and unit length,
  each pair written in turn as S <- S + beta k (v - S^T k)^T with beta = sigmoid(x W_beta) per head from the key's
  embedding, then read y = q S: head_size x head_size per head and no normaliser, the same bytes as "identity". The
  order of the pairs matters here (a later key can overwrite an earlier one's value); the reads come after the last
  write, as MQAR's queries come after the context.
- "softmax": softmax attention over the stored keys, i.e. its cache of every key and value. Its memory grows with
  the pairs; it is the reference with no capacity limit.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from hf_linear_attn.delta_rule import causal_delta_rule, delta_rule_qk
from hf_linear_attn.feature_maps import EluFeatureMap, HedgehogFeatureMap
from hf_linear_attn.linear_attention import bidirectional_linear_attention
from hf_linear_attn.training.errors import UsageError

MEMORIES = ("elu", "elu_unnormalized", "identity", "hedgehog", "hedgehog_narrow", "delta", "softmax")
NORMALISED = ("elu", "hedgehog", "hedgehog_narrow")  # read as linear_gpt2 reads: phi(q) S / (phi(q) . z + eps)
EPS = 1e-6  # linear_gpt2's default linear_attention_eps


def check_capacity(memory: str, num_keys: int, num_values: int, pairs: int, heads: int, head_size: int) -> None:
    """Refuse settings the probe cannot run, naming the fix, before anything is built."""
    if memory not in MEMORIES:
        raise UsageError(f"unknown memory {memory!r}; choose one of {', '.join(MEMORIES)}")
    if heads < 1 or head_size < 1:
        raise UsageError(f"heads and head_size must be positive, got heads={heads}, head_size={head_size}")
    if pairs < 1 or pairs > num_keys:
        raise UsageError(f"pairs must be between 1 and num_keys ({num_keys}) so that the keys of a sequence are "
                         f"distinct, got {pairs}: lower pairs or raise num_keys")
    if num_values < 2:
        raise UsageError(f"num_values must be at least 2, got {num_values}")


def state_bytes(memory: str, pairs: int, heads: int, head_size: int) -> int:
    """Float32 bytes of what the memory keeps per sequence: S (and z where normalised) per head for the linear ones,
    every key and value for softmax."""
    if memory == "softmax":
        return 4 * 2 * pairs * heads * head_size
    features = feature_count(memory, head_size)
    per_head = features * head_size + (features if memory in NORMALISED else 0)
    return 4 * heads * per_head


def feature_count(memory: str, head_size: int) -> int:
    """The features per head a linear memory's keys become (the rows of its state S)."""
    return {"hedgehog": 2 * head_size, "hedgehog_narrow": 2 * (head_size // 2)}.get(memory, head_size)


def pair_batch(batch_size: int, pairs: int, num_keys: int, num_values: int, generator: torch.Generator):
    """(keys, values), both (batch, pairs) long: distinct keys per row, values drawn uniformly (MQAR's pairing)."""
    keys = torch.rand(batch_size, num_keys, generator=generator).argsort(-1)[:, :pairs]
    values = torch.randint(num_values, (batch_size, pairs), generator=generator)
    return keys, values


class StateMemory(nn.Module):
    """Stores a batch of (key, value) pairs in one layer's memory, then reads every key back: logits over the values,
    (batch, pairs, num_values), row j answering the query of key j."""

    def __init__(self, memory: str, num_keys: int, num_values: int, heads: int, head_size: int):
        super().__init__()
        self.memory, self.heads, self.head_size = memory, heads, head_size
        width = heads * head_size
        self.key_embed = nn.Embedding(num_keys, width)
        self.value_embed = nn.Embedding(num_values, width)
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.readout = nn.Linear(width, num_values)
        if memory == "delta":  # a step size per head from the key's embedding (the decoder's b_proj)
            self.b_proj = nn.Linear(width, heads, bias=False)
        if memory in ("hedgehog", "hedgehog_narrow"):
            self.feature_map = HedgehogFeatureMap(heads, head_size, feature_count(memory, head_size) // 2)
        else:
            self.feature_map = EluFeatureMap()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, D, width) -> (B, H, D, d)
        return x.unflatten(-1, (self.heads, self.head_size)).transpose(1, 2)

    def read(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The memory's output for each stored key as query: (B, H, D, d)."""
        embedded = self.key_embed(keys)
        q, k = self._heads(self.q_proj(embedded)), self._heads(self.k_proj(embedded))
        v = self._heads(self.v_proj(self.value_embed(values)))
        if self.memory == "softmax":
            return F.scaled_dot_product_attention(q, k, v)
        if self.memory == "identity":
            return q @ (k.transpose(-1, -2) @ v)
        if self.memory == "delta":  # write the pairs in order with the rule, then read every key from the last state
            q, k = delta_rule_qk(q, k)
            beta = torch.sigmoid(self.b_proj(embedded).float()).transpose(1, 2)  # (B, H, D)
            _, state = causal_delta_rule(k, k, v, beta)
            return (q @ state).to(v.dtype)
        phi_q, phi_k = self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)
        if self.memory == "elu_unnormalized":
            return phi_q @ (phi_k.transpose(-1, -2) @ v)
        return bidirectional_linear_attention(phi_q, phi_k, v, eps=EPS)

    def forward(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self.readout(self.read(keys, values).transpose(1, 2).flatten(2))


@torch.no_grad()
def evaluate(model: StateMemory, pairs: int, num_keys: int, num_values: int, batches: int, batch_size: int,
             seed: int) -> dict:
    """Accuracy and loss of reading every stored key back, over fresh batches from their own seed."""
    generator = torch.Generator().manual_seed(seed)
    right, total, losses = 0, 0, []
    for _ in range(batches):
        keys, values = pair_batch(batch_size, pairs, num_keys, num_values, generator)
        logits = model(keys, values)
        losses.append(F.cross_entropy(logits.flatten(0, 1), values.flatten()).item())
        right += int((logits.argmax(-1) == values).sum())
        total += values.numel()
    return {"accuracy": right / total, "loss": sum(losses) / len(losses), "queries": total}


def train_capacity(memory: str, num_keys: int, num_values: int, pairs: int, heads: int, head_size: int,
                   steps: int, batch_size: int, lr: float, seed: int, eval_batches: int = 16,
                   log_every: int = 100) -> dict:
    """Train a StateMemory on fresh pairings (AdamW without weight decay, cosine decay after a 5% warm-up, clipping
    at 1), then score it on held-out pairings. The loss curve lets a reader see whether it converged."""
    check_capacity(memory, num_keys, num_values, pairs, heads, head_size)
    torch.manual_seed(seed)
    model = StateMemory(memory, num_keys, num_values, heads, head_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * max(0, s + 1 - warmup) / max(1, steps - warmup)))))
    generator = torch.Generator().manual_seed(seed)
    curve, running = [], []
    for step in range(1, steps + 1):
        keys, values = pair_batch(batch_size, pairs, num_keys, num_values, generator)
        loss = F.cross_entropy(model(keys, values).flatten(0, 1), values.flatten())
        if not torch.isfinite(loss):
            raise RuntimeError(f"{memory}: loss became {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        running.append(loss.item())
        if step % log_every == 0 or step == steps:
            curve.append((step, sum(running) / len(running)))
            running = []
    scored = evaluate(model, pairs, num_keys, num_values, eval_batches, batch_size, seed + 10_000)
    return {**scored, "loss_curve": curve, "state_bytes": state_bytes(memory, pairs, heads, head_size)}
