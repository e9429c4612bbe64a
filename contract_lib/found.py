"""A campaign's minimal workload as a TOML file under ``data/workloads/found/``, with a
header stating how it was found and the violation it shows (:mod:`contract_lib.search`)."""

from __future__ import annotations

import json
from typing import Any

from contract_lib.workloads import WORKLOAD_DIR, Workload

FOUND_DIR = WORKLOAD_DIR / "found"


def workload_size(workload: Workload) -> dict[str, int]:
    """How big a workload is: requests, prompt tokens, new tokens, server-arg overrides."""
    return {"requests": len(workload.requests),
            "prompt_tokens": sum(len(r.prompt) for r in workload.requests),
            "new_tokens": sum(r.max_new_tokens for r in workload.requests),
            "server_args": len(workload.server_args)}


def to_toml(workload: Workload, header: list[str]) -> str:
    """The workload as a TOML file (``#`` header lines first) that :func:`load_workload`
    reads back to the same workload."""
    lines = [f"# {line}" if line else "#" for line in header]
    lines += [f"name = {_toml(workload.name)}", f"max_steps = {workload.max_steps}"]
    if workload.description:
        lines.append(f"description = {_toml(workload.description)}")
    if workload.server_args:
        lines += ["", "[server_args]"]
        lines += [f"{k} = {_toml(v)}" for k, v in workload.server_args.items()]
    for spec in workload.requests:
        lines += ["", "[[requests]]", f"rid = {_toml(spec.rid)}"]
        if spec.turn_of:
            lines.append(f"turn_of = {_toml(spec.turn_of)}")
        lines += [f"prompt = {_toml(list(spec.prompt))}",
                  f"max_new_tokens = {spec.max_new_tokens}", f"arrival = {spec.arrival}"]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, (bool, str)):
        return json.dumps(value)  # JSON's true/false and escaped strings are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)
