"""The padding masks the models take: 1 (or True) at real tokens, 0 (or False) at padding, as tokenizers return."""

import torch


def check_padding_mask(mask: torch.Tensor) -> None:
    """Raise a ValueError when ``mask`` holds anything but 0 and 1 (any dtype): an additive mask (0 / -inf) would
    otherwise be read the other way round (its 0s, the real tokens, as padding), and a 2 would shift positions.

    Reads tensor values, so it runs in eager mode only (a compiled or exported graph keeps no data-dependent branch).
    """
    if mask.dtype == torch.bool or torch.compiler.is_compiling():
        return
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        values = sorted({float(value) for value in mask[bad].flatten()[:1000].tolist()})[:4]
        raise ValueError(
            f"attention_mask must be 1 at real tokens and 0 at padding (int, bool or float), but it holds {values}. "
            "An additive mask (0 at real tokens, -inf or a large negative number at padding) is the other convention: "
            "pass the tokenizer's attention_mask, or (mask == 0) of an additive one."
        )
