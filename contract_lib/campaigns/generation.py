"""What the search generates: valid workloads as a Hypothesis strategy (:func:`workloads`)
for :mod:`contract_lib.campaigns.search`.

1-4 requests with prompt lengths, a shared prefix, arrival iterations, later turns
(``turn_of``) and ``max_new_tokens``, and server args (``chunked_prefill_size``,
``enable_mixed_chunk``, a small ``max_total_tokens`` with ``schedule_conservativeness``
0.01, ``max_running_requests``, ``schedule_policy``, ``disable_radix_cache``). Every
choice shrinks towards "simpler".
"""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import strategies as st

from contract_lib.workloads import Workload

# Deterministic policies only ("random" would make frames differ between runs);
# "routing-key" needs routing keys the workload format does not have.
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")
MAX_REQUESTS, MAX_NEW_TOKENS = 4, 24
MAX_OWN_PROMPT, MAX_PREFIX = 48, 32  # tokens: a request's own prompt, the shared prefix
MAX_ARRIVAL = 12                     # loop iterations


# One request's choices: (turn, shared, own prompt length, max_new_tokens, arrival).
# ``turn`` 0 is a first turn; k > 0 makes request i a later turn of request (k-1) % i.
_REQUEST = st.tuples(st.integers(0, MAX_REQUESTS - 1), st.booleans(),
                     st.integers(0, MAX_OWN_PROMPT), st.integers(1, MAX_NEW_TOKENS),
                     st.integers(0, MAX_ARRIVAL))


@st.composite
def workloads(draw: Callable[[st.SearchStrategy], Any], turns: bool = True) -> Workload:
    """A valid workload (ids 10..291, every context well inside 1024 tokens) and server
    args that keep SGLang in the loop asked for. Requests are a list, so shrinking can
    delete any of them; every choice shrinks towards "simpler": fewer requests, shorter
    prompts, arrival 0, no turn, no shared prefix, no server-arg override. ``turns``
    False: no later turn (a PD prefill side refuses ``turn_of``: its requests end at
    their first token, so a turn's prompt would not be ``event_loop_normal``'s)."""
    prefix = tuple(range(10, 10 + draw(st.integers(0, MAX_PREFIX))))
    raw = draw(st.lists(_REQUEST, min_size=1, max_size=MAX_REQUESTS))
    requests: list[dict[str, Any]] = []
    context: dict[str, int] = {}  # rid -> longest context (prompt + output), tokens
    for index, (turn, shared, own, new, arrival) in enumerate(raw):
        rid = "abcd"[index]
        turn_of = requests[(turn - 1) % index]["rid"] if turns and turn and index else None
        shared = shared and bool(prefix) and turn_of is None
        start = 100 + MAX_OWN_PROMPT * index  # distinct tails: ids 100..291
        own = max(own, 0 if (turn_of or shared) else 1)
        prompt = (prefix if shared else ()) + tuple(range(start, start + own))
        request = {"rid": rid, "prompt": list(prompt), "max_new_tokens": new,
                   "arrival": arrival}
        if turn_of:
            request["turn_of"] = turn_of
        requests.append(request)
        context[rid] = len(prompt) + new + (context[turn_of] if turn_of else 0)
    server_args = _server_args(draw, longest=max(context.values()))
    budget = sum(context.values()) + 4 * sum(r["arrival"] for r in requests)
    return Workload.from_dict({"name": "generated", "max_steps": 200 + 4 * budget,
                               "server_args": server_args, "requests": requests},
                              source="generated workload")


def _server_args(draw, longest: int) -> dict[str, Any]:
    """Overrides drawn one by one, each absent unless drawn (absent shrinks first). The
    KV pool is 8-40 tokens above the longest request's context: small enough that
    concurrent requests run out of it, never so small that one alone cannot fit. No
    ``page_size``: the MLX loop refuses any value above 1 (SGLang's MLX backend builds a
    token-level KV allocator), so the example would only be rejected there."""
    args: dict[str, Any] = {}
    choices = {
        "chunked_prefill_size": st.sampled_from((8, 16, 32)),
        "enable_mixed_chunk": st.just(True),
        "max_total_tokens": st.integers(longest + 8, longest + 40),
        # Near zero: admission barely reserves decode KV, so a small pool runs out in
        # decode and SGLang retracts a request (the retraction path).
        "schedule_conservativeness": st.just(0.01),
        "max_running_requests": st.integers(1, 3),
        "schedule_policy": st.sampled_from(SCHEDULE_POLICIES[1:]),
        "disable_radix_cache": st.just(True),
    }
    for key, strategy in choices.items():
        if draw(st.booleans()):
            args[key] = draw(strategy)
    return args
