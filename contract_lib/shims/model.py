"""The fake model: a deterministic next-token function, the same on every loop."""

from __future__ import annotations

from contract_lib.workloads import FIRST_ORDINARY_TOKEN

# The vocabulary of the fake model. Token ids below FIRST_ORDINARY_TOKEN are never
# emitted, which keeps SGLang's EOS (id 2 in the shipped config) and other special ids
# out of the way.
VOCAB_SIZE = 512


def next_token(last_token: int, seq_len: int) -> int:
    """The fake model: the token that follows ``last_token`` in a sequence of ``seq_len``.

    ``seq_len`` counts every token whose KV the step has computed, the input token
    included. It depends only on the request's own history, so every loop emits the
    same tokens when it computes the right positions. Also evaluated elementwise on
    ``mlx.core`` arrays (the MLX runner's lazy graph), hence only arithmetic here.
    """
    span = VOCAB_SIZE - FIRST_ORDINARY_TOKEN
    return FIRST_ORDINARY_TOKEN + (last_token * 31 + seq_len * 17 + 7) % span

