"""Recall (issue 42): multi-query associative recall (MQAR) against the size of each decoder's decoding state, and
passkey retrieval in WikiText-2 text.

The code: `tasks` (the MQAR generator and its independent checker), `passkey` (the passkey generator and its
independent checker), `models` (the decoders, the state each carries), `training` (the loops and the scores at the
positions that recall), `runner` (MQAR: preset, stages, report), `passkey_runner` (passkey: tokenizer, pretraining,
fine-tune and score as stages, report), `capacity` and `capacity_runner` (the capacity probe: one layer's state
trained alone on MQAR's pairs).
"""

import json
from pathlib import Path


def preset_task(path: Path) -> str:
    """Which runner a recall preset is for: its "task" key ("passkey", "capacity"), else "mqar". A file that cannot
    be read as a preset is "mqar" here: the MQAR loader names what is wrong with it."""
    try:
        return json.loads(Path(path).read_text()).get("task") or "mqar"
    except (OSError, json.JSONDecodeError, AttributeError):
        return "mqar"
