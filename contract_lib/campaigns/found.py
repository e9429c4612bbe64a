"""A campaign's minimal workload as a TOML file under ``data/workloads/found/``, with a
header stating how it was found and the violation it shows (:mod:`contract_lib.campaigns.search`)."""

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
    reads back to an equal workload: every field of :class:`Workload` and
    :class:`RequestSpec` that differs from its default is written."""
    lines = [f"# {part}" if part else "#" for line in header for part in line.split("\n")]
    lines += [f"name = {_toml(workload.name)}", f"max_steps = {workload.max_steps}"]
    if workload.max_seconds is not None:
        lines.append(f"max_seconds = {_toml(workload.max_seconds)}")
    if workload.description:
        lines.append(f"description = {_toml(workload.description)}")
    for table in ("server_args", "expect"):
        if getattr(workload, table):
            lines += ["", f"[{table}]"]
            lines += [f"{_key(k)} = {_toml(v)}" for k, v in getattr(workload, table).items()]
    for spec in workload.requests:
        lines += ["", "[[requests]]", f"rid = {_toml(spec.rid)}"]
        if spec.turn_of:
            lines.append(f"turn_of = {_toml(spec.turn_of)}")
        lines += [f"prompt = {_toml(list(spec.prompt))}",
                  f"max_new_tokens = {spec.max_new_tokens}", f"arrival = {spec.arrival}"]
        optional = {"stop_token_ids": list(spec.stop_token_ids) or None,
                    "emit": dict(spec.emit) or None, "ignore_eos": spec.ignore_eos or None,
                    "abort_at": spec.abort_at, "priority": spec.priority}  # None: default
        lines += [f"{name} = {_toml(value)}" for name, value in optional.items()
                  if value is not None]
    return "\n".join(lines) + "\n"


def _key(key: Any) -> str:
    """A TOML key: bare when it can be, else quoted."""
    key = str(key)
    return key if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) \
        else _toml(key)


def _toml(value: Any) -> str:
    """A TOML value; TypeError for what TOML cannot hold (None)."""
    if isinstance(value, str):  # JSON's escapes are TOML's, but for DEL and surrogates
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (int, float)):
        return repr(value)  # inf and nan are TOML's too
    raise TypeError(f"a workload value TOML cannot hold: {value!r}")
