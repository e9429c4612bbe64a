"""A workload as a TOML file (a campaign's minimal workload under
``data/workloads/found/``, a report's ``workload.toml``), with a header of comment lines
stating where it comes from; :func:`load_workload` reads it back to the same workload."""

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
    """The workload as a TOML file (``#`` header lines first), every field it sets."""
    lines = [f"# {line}" if line else "#" for line in header]
    lines += [f"name = {_toml(workload.name)}", f"max_steps = {workload.max_steps}"]
    if workload.max_seconds is not None:
        lines.append(f"max_seconds = {workload.max_seconds!r}")
    if workload.description:
        lines.append(f"description = {_toml(workload.description)}")
    for table in ("server_args", "expect"):
        values = getattr(workload, table)
        if values:
            lines += ["", f"[{table}]"] + [f"{k} = {_toml(v)}" for k, v in values.items()]
    for spec in workload.requests:
        lines += ["", "[[requests]]", f"rid = {_toml(spec.rid)}"]
        if spec.turn_of:
            lines.append(f"turn_of = {_toml(spec.turn_of)}")
        lines += [f"prompt = {_toml(list(spec.prompt))}",
                  f"max_new_tokens = {spec.max_new_tokens}", f"arrival = {spec.arrival}"]
        if spec.stop_token_ids:
            lines.append(f"stop_token_ids = {_toml(list(spec.stop_token_ids))}")
        if spec.emit:
            lines.append("emit = { " + ", ".join(f"{p} = {t}" for p, t in spec.emit) + " }")
        if spec.ignore_eos:
            lines.append("ignore_eos = true")
        for key in ("abort_at", "priority"):
            if getattr(spec, key) is not None:
                lines.append(f"{key} = {getattr(spec, key)}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, (bool, str)):
        return json.dumps(value)  # JSON's true/false and escaped strings are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)
