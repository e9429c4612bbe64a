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



# The workload's ``emit``: {rid: {output position: token}} (``install_token_script``).
_TOKEN_SCRIPT: dict[str, dict[int, int]] = {}


def install_token_script(script: dict[str, dict[int, int]]) -> None:
    """Make the model-free forwards emit ``script[rid][k]`` as output token ``k`` of
    request ``rid`` (a workload's ``emit``: a stop token or EOS at a chosen position).

    Why: stop-token and EOS finishes need the model to emit a chosen token; the script is
    part of the fake model (its "weights"), read by :func:`scripted_token` on every path.
    """
    _TOKEN_SCRIPT.clear()
    _TOKEN_SCRIPT.update({rid: dict(tokens) for rid, tokens in script.items()})


def scripted_token(rid: str, seq_len: int, prompt_len: int) -> int | None:
    """The scripted token of ``rid`` for a step that computes ``seq_len`` positions of a
    request whose prompt is ``prompt_len`` tokens (output position ``seq_len -
    prompt_len``: the input token is the previous output, or the prompt's last), or None.
    A pure function of the request and the position, so every loop (and a retracted
    request's re-prefill) emits the same tokens."""
    return _TOKEN_SCRIPT.get(rid, {}).get(seq_len - prompt_len)
