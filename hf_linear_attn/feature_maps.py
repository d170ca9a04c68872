"""Feature maps phi for kernelized linear attention (layer 1: torch only, no transformers import).

Every map takes per-head vectors ``x`` of shape (batch, heads, n, head_dim) and returns non-negative features of
shape (batch, heads, n, feature_dim) in float32, whatever the input dtype: the sums built from them (S, z and the
normaliser) must accumulate in float32, and exp-based maps overflow in fp16.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

FEATURE_MAPS = ("elu", "relu", "favor", "hedgehog")


class FeatureMap(nn.Module):
    """A feature map: ``forward(x, is_query, key_mask)`` maps queries or keys; :meth:`pair` maps both at once."""

    def pair(self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None):
        """(phi(Q), phi(K)) for the queries and keys of one attention call; maps whose features depend on the
        other side (FAVOR+'s joint stabiliser) override it."""
        return self(q, is_query=True), self(k, is_query=False, key_mask=key_mask)


class EluFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020): (B, H, n, d) -> (B, H, n, d)."""

    def forward(self, x: torch.Tensor, is_query: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.elu(x.float()) + 1.0


class ReluFeatureMap(FeatureMap):
    """phi(x) = relu(x): (B, H, n, d) -> (B, H, n, d). A row of zeros leaves only eps in the normaliser."""

    def forward(self, x: torch.Tensor, is_query: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.relu(x.float())


# Under torch.export the running maximum is a doubling scan of this many steps (positions up to 2^20), not cummax,
# which ONNX lacks: steps past the length change nothing, so the count needs no n.
EXPORT_MAX_STEPS = 20


def _cumulative_max(x: torch.Tensor) -> torch.Tensor:
    """max over positions j <= t along dim -2: torch.cummax, or under torch.export the doubling scan (Hillis and
    Steele: after the step of shift s every row holds the maximum of the 2s rows up to it), exact either way."""
    if not torch.compiler.is_exporting():
        return torch.cummax(x, dim=-2).values
    positions = torch.arange(x.shape[-2], device=x.device)
    for step in range(EXPORT_MAX_STEPS):
        shift = 2**step
        earlier = x.index_select(-2, (positions - shift).clamp(min=0))
        x = torch.where((positions >= shift)[:, None], torch.maximum(x, earlier), x)
    return x


def orthogonal_gaussian_matrix(
    num_rows: int, dim: int, generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """(num_rows, dim) matrix whose rows are orthogonal in blocks of ``dim`` with Gaussian-distributed norms."""
    if device is None and generator is not None:
        device = generator.device  # draw where the generator lives (the same numbers whatever the default device)
    blocks = []
    for _ in range(math.ceil(num_rows / dim)):
        gaussian = torch.randn(dim, dim, generator=generator, device=device)
        q, _ = torch.linalg.qr(gaussian)
        blocks.append(q.T)
    directions = torch.cat(blocks)[:num_rows]
    # Rows of a Gaussian matrix have chi-distributed norms; orthogonal rows must keep them for unbiasedness.
    norms = torch.randn(num_rows, dim, generator=generator, device=device).norm(dim=1, keepdim=True)
    return directions * norms


class FavorFeatureMap(FeatureMap):
    """Performer FAVOR+ positive random features for the softmax kernel exp(q.k / sqrt(d)).

    phi(x) = m^-1/2 exp(w_i . x' - |x'|^2 / 2 - c) with x' = x / d^(1/4) and orthogonal Gaussian rows w_i
    (Choromanski et al. 2020). The random matrix is a persistent buffer, so a saved model reproduces exactly and
    evaluation is deterministic; :meth:`redraw` draws a new one (the same on every distributed process).

    The stabiliser c is a constant that cancels in the normalised attention: for queries it is the row's own
    maximum; for keys in bidirectional mode the maximum over the (non-pad) keys of the sequence. ``forward`` in
    causal mode gives keys no stabiliser, since any maximum over the sequence would look at future tokens (in
    float32 the exponent is bounded by |w|^2 / 2, which does not overflow, but it underflows at large norms);
    :meth:`causal_pair` is what causal attention calls instead.

    :meth:`pair` (what the attention layers call) stabilises queries and keys jointly in bidirectional mode: each
    feature i of the keys by its own maximum c_i over the sequence, with c_i added to the queries' logit i, so
    every product phi(q)_i phi(k_j)_i is unchanged up to one constant per query, which cancels. The normaliser
    phi(q) . z is then at least 1 / m whatever the scale of q and k, where separate stabilisers can leave it far
    below eps (keys and queries of norm ~1.5 per dimension at d = 64 already let eps shrink half the outputs by
    more than 1%). :meth:`causal_pair` does the same causally, with the running maximum over the keys so far.
    """

    def __init__(self, head_dim: int, num_features: int, causal: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.num_features = num_features
        self.causal = causal
        self.projection = nn.Buffer(orthogonal_gaussian_matrix(num_features, head_dim), persistent=True)

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a new random matrix; under torch.distributed, rank 0's draw is broadcast to every process."""
        new = orthogonal_gaussian_matrix(self.num_features, self.head_dim, generator=generator)
        new = new.to(device=self.projection.device, dtype=self.projection.dtype)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast(new, src=0)
        self.projection.copy_(new)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """w_i . x' - |x'|^2 / 2 for every feature i: (B, H, n, m)."""
        x = x.float() * self.head_dim**-0.25
        return torch.matmul(x, self.projection.float().T) - 0.5 * (x * x).sum(-1, keepdim=True)

    def pair(self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None):
        if self.causal:
            return super().pair(q, k, key_mask)
        key_logits = self._logits(k)
        if key_mask is not None:  # pad keys: -inf, so their features are 0 (and so are their gradients)
            key_logits = key_logits.masked_fill(~key_mask[:, None, :, None], -torch.inf)
        per_feature = key_logits.amax(dim=-2, keepdim=True).detach()  # (B, H, 1, m)
        per_feature = torch.where(torch.isfinite(per_feature), per_feature, 0.0)  # an all-pad row
        query_logits = self._logits(q) + per_feature
        scale = self.num_features**-0.5
        phi_q = torch.exp(query_logits - query_logits.amax(dim=-1, keepdim=True).detach()) * scale
        return phi_q, torch.exp(key_logits - per_feature) * scale

    def causal_pair(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        running_max: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal FAVOR+ stabilised without looking ahead: (phi(Q), phi(K), log a (B, H, n, m), the running maximum at
        every position (B, H, n, m); its last row is what the next call continues from).

        Key feature i at position j is scaled by exp(-c_t,i), c_t,i the largest logit i among the real keys up to t
        (``running_max`` (B, H, m) carries it from earlier calls; -inf where no key was seen yet), and the query at t
        gets c_t,i added to its logit i: every product phi(q_t)_i phi(k_j)_i is then the unstabilised one times a
        constant of the query, which cancels, as in the bidirectional :meth:`pair`, and phi(q_t) . z_t >= 1 / m
        whatever the norms (the largest product is exactly 1 / m). The catch is that the scale of key j changes as
        the maximum grows after it: a state built under c_{t-1} is brought under c_t by the decay
        a_t,i = exp(c_{t-1},i - c_t,i) <= 1, so the decayed kernel (decayed_linear_attention) computes the
        stabilised attention exactly, chunked, in a state of fixed size. The maxima are constants (detached): they
        cancel in the output, so no gradient flows through them.
        """
        key_logits = self._logits(k)
        if key_mask is not None:  # pad keys: -inf, so their features are 0 and they never raise the maximum
            key_logits = key_logits.masked_fill(~key_mask[:, None, :, None], -torch.inf)
        running = _cumulative_max(key_logits.detach())
        if running_max is None:
            before = torch.full_like(running[:, :, :1], -torch.inf)
        else:
            before = running_max.float()[:, :, None, :].expand_as(running[:, :, :1])
            running = torch.maximum(running, before)
        # c_{t-1}: the maximum one position back (an index, not a slice of n - 1 rows, which would fix n under export)
        positions = torch.arange(running.shape[2], device=running.device)
        previous = running.index_select(2, (positions - 1).clamp(min=0))
        previous = torch.where((positions == 0)[:, None], before, previous)
        stabiliser = torch.where(torch.isfinite(running), running, 0.0)  # 0 until the first real key
        # before the first key the state is empty: nothing to rescale (and c_{t-1} - c_t would be -inf - c)
        log_decay = torch.where(torch.isfinite(previous), previous - stabiliser, 0.0)
        scale = self.num_features**-0.5
        phi_k = torch.exp(key_logits - stabiliser) * scale
        query_logits = self._logits(q) + stabiliser
        phi_q = torch.exp(query_logits - query_logits.amax(dim=-1, keepdim=True).detach()) * scale
        return phi_q, phi_k, log_decay, running

    def forward(self, x: torch.Tensor, is_query: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        logits = self._logits(x)
        if is_query:
            stabiliser = logits.amax(dim=-1, keepdim=True).detach()
        elif self.causal:
            stabiliser = torch.zeros((), device=x.device)
        else:
            masked = logits if key_mask is None else logits.masked_fill(~key_mask[:, None, :, None], -torch.inf)
            stabiliser = masked.amax(dim=(-2, -1), keepdim=True).detach()
            stabiliser = torch.where(torch.isfinite(stabiliser), stabiliser, 0.0)  # an all-pad row
        return torch.exp(logits - stabiliser) * self.num_features**-0.5


class HedgehogFeatureMap(FeatureMap):
    """Learnable per-head map phi(x) = [softmax(x W_h), softmax(-x W_h)] (Zhang et al. 2024, "Hedgehog").

    W_h is (head_dim, feature_dim) per head, initialised to the identity; the output has 2 * feature_dim features.
    The softmax over features keeps phi positive and bounded, so it is stable in any precision.
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, feature_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity start: the map is then a fixed function of x, not of a random draw."""
        self.weight.copy_(identity_weight(self.weight))

    def forward(self, x: torch.Tensor, is_query: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        projected = torch.matmul(x.float(), self.weight.float())  # (B, H, n, f)
        return torch.cat([projected.softmax(-1), (-projected).softmax(-1)], dim=-1)


def identity_weight(weight: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``weight`` (heads, d, f) holding the (rectangular) identity for every head."""
    eye = torch.eye(weight.shape[-2], weight.shape[-1], device=weight.device, dtype=weight.dtype)
    return eye.expand_as(weight).clone()


def build_feature_map(
    name: str,
    num_heads: int,
    head_dim: int,
    num_random_features: int = 256,
    learned_feature_dim: int | None = None,
    causal: bool = False,
) -> nn.Module:
    """The feature map called ``name`` (one of FEATURE_MAPS) for heads of size ``head_dim``."""
    if name == "elu":
        return EluFeatureMap()
    if name == "relu":
        return ReluFeatureMap()
    if name == "favor":
        return FavorFeatureMap(head_dim, num_random_features, causal=causal)
    if name == "hedgehog":
        return HedgehogFeatureMap(num_heads, head_dim, learned_feature_dim or head_dim)
    raise ValueError(f"Unknown feature map {name!r}; choose one of {', '.join(FEATURE_MAPS)}.")


def check_feature_map_options(
    feature_map: str, num_random_features: int, learned_feature_dim: int | None, eps: float
) -> None:
    """Raise a ValueError naming the bad option of a linear-attention config."""
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"Unknown feature_map {feature_map!r}; choose one of {', '.join(FEATURE_MAPS)}.")
    if num_random_features < 1:
        raise ValueError(f"num_random_features must be positive, got {num_random_features}.")
    if learned_feature_dim is not None and learned_feature_dim < 1:
        raise ValueError(f"learned_feature_dim must be positive or None, got {learned_feature_dim}.")
    if not eps > 0:
        raise ValueError(f"linear_attention_eps must be > 0 (it keeps the normaliser away from 0), got {eps}.")
