"""Recall (issue 42): multi-query associative recall (MQAR) against the size of each decoder's decoding state, and
passkey retrieval in WikiText-2 text.

The code: `tasks` (the MQAR generator and its independent checker), `passkey` (the passkey generator and its
independent checker), `models` (the decoders, the state each carries), `training` (the loops and the scores at the
positions that recall), `runner` (MQAR: preset, stages, report), `passkey_runner` (passkey: tokenizer, pretraining,
fine-tune and score as stages, report).
"""
