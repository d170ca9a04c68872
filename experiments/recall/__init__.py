"""Recall (issue 42): multi-query associative recall (MQAR) against the size of each decoder's decoding state.

The code: `tasks` (the generator and its independent checker), `models` (the decoders, the state each carries),
`training` (the loop and the score at query positions), `runner` (preset, stages, report).
"""
