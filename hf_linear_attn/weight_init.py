"""Init of the parameters this package adds to RoBERTa / GPT-2 (feature maps, Linformer projections, window factors,
short convolutions).

Shared by the encoders and the decoders: both style base models call :func:`init_added_weights` from their
``_init_weights``. The ``transformers.initialization`` functions skip weights that were loaded from a checkpoint, so
these are safe to call from ``_init_weights``.
"""

import torch
from torch import nn
from transformers import initialization as init

from .delta_rule import DeltaRuleGate, DeltaRuleOutputNorm, delta_rule_gate_init
from .feature_maps import FavorFeatureMap, HedgehogFeatureMap, identity_weight, orthogonal_gaussian_matrix
from .linformer_projection import (
    STRUCTURED_INITS, LinformerProjection, multiscale_matrix, pooling_matrix, xavier_bound,
)
from .short_convolution import ShortConvolution, short_convolution_init_bound
from .sliding_window_attention import SlidingWindowFactor


def init_feature_map(module: nn.Module) -> None:
    """FAVOR+ draws orthogonal random features; hedgehog starts at the identity; other modules are left alone."""
    if isinstance(module, FavorFeatureMap):
        projection = orthogonal_gaussian_matrix(module.num_features, module.head_dim)
        init.copy_(module.projection, projection.to(module.projection.device))
    elif isinstance(module, HedgehogFeatureMap):
        init.copy_(module.weight, identity_weight(module.weight))


def init_linformer_projection(module: nn.Module, linformer_init: str, initializer_range: float) -> None:
    """E / F by ``linformer_init``: "xavier_uniform" (fairseq, gain 1/sqrt 2), "normal" N(0, initializer_range) or
    "pooling" (mean over consecutive windows of max_length / k positions) or "multiscale" (k // 2 single positions,
    then pooled windows)."""
    if not isinstance(module, LinformerProjection):
        return
    k, max_length = module.weight.shape[-2:]
    if linformer_init in STRUCTURED_INITS:
        build = pooling_matrix if linformer_init == "pooling" else multiscale_matrix
        init.copy_(module.weight, build(k, max_length).expand_as(module.weight).to(module.weight.device))
    elif linformer_init == "normal":
        init.normal_(module.weight, mean=0.0, std=initializer_range)
    else:
        bound = xavier_bound(k, max_length)
        init.uniform_(module.weight, -bound, bound)


def init_added_weights(module: nn.Module, config) -> None:
    """Init of ``module`` if it is a part this package adds: a feature map (:func:`init_feature_map`), Linformer's E / F
    (:func:`init_linformer_projection` by ``config.linformer_init``), a window factor (its config's start,
    ``attention_window_factor_init``: 0 by default, g = 1), a short convolution (PyTorch's Conv1d default) or Gated
    DeltaNet's gate (:func:`~.delta_rule.delta_rule_gate_init`, from its ``dt_range``) and its output norm (ones); any
    other module is left alone."""
    init_feature_map(module)
    if isinstance(module, LinformerProjection):
        init_linformer_projection(module, config.linformer_init, config.initializer_range)
    elif isinstance(module, SlidingWindowFactor):
        init.constant_(module.log_factor, module.init)
    elif isinstance(module, DeltaRuleGate):  # Mamba-2's A and dt, as fla's GatedDeltaNet and KDA start them
        a_log, dt_bias = delta_rule_gate_init(module.A_log.shape[0], features=module.head_dim or 1,
                                              dt_range=module.dt_range)
        init.copy_(module.A_log, a_log.to(module.A_log.device))
        init.copy_(module.dt_bias, dt_bias.to(module.dt_bias.device))
    elif isinstance(module, DeltaRuleOutputNorm):  # RMSNorm's start, a weight of ones (its g_proj: a Linear's)
        init.ones_(module.weight)
    elif isinstance(module, ShortConvolution):
        # PyTorch's own Conv1d init, U(-1/sqrt(K), 1/sqrt(K)), which mamba_ssm's convolutions keep too (its init
        # touches only Linear and Embedding). It replaces transformers' generic N(0, initializer_range) for any
        # nn.Conv1d (fla's models keep that one): at GPT-2's 0.02 it would shrink q, k, v some 50-fold, starting each
        # linear layer near silent.
        bound = short_convolution_init_bound(module.kernel_size[0])
        init.uniform_(module.weight, -bound, bound)


@torch.no_grad()
def redraw_random_features(model: nn.Module, generator: torch.Generator | None = None) -> int:
    """Draw new FAVOR+ features in every layer of ``model`` (rank 0's draw on every process); returns how many."""
    maps = [m for m in model.modules() if isinstance(m, FavorFeatureMap)]
    for feature_map in maps:
        feature_map.redraw(generator)
    return len(maps)


class RandomFeaturesMixin:
    """What a model whose feature maps may be FAVOR+ adds (both linear-attention families): ``redraw_random_features``."""

    def redraw_random_features(self, generator: torch.Generator | None = None) -> int:
        """Draw new FAVOR+ features in every layer (rank 0's draw on every process); returns the number redrawn."""
        return redraw_random_features(self, generator)
