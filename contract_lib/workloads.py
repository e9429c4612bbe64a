"""Declarative workloads: which requests arrive at which loop iteration, with what prompt.

The TOML format, every field and its default: ``docs/workloads.md``. Token ids below
10 are reserved (2 is EOS); a workload file is read only if it is a regular file of at
most :data:`MAX_WORKLOAD_BYTES`.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from pathlib import Path
from typing import Any

from contract_lib.paths import WORKLOAD_DIR
from contract_lib.trust import UntrustedError, read_user_file

# Token ids below this are reserved: the model-free next-token function and the tiny
# model never emit them (2 is EOS).
FIRST_ORDINARY_TOKEN = 10


# A workload file is read only if it is a regular file of at most this many bytes (the
# shipped ones are under 2 KB; a thousand requests fit in well under this).
MAX_WORKLOAD_BYTES = 1 << 20
WORKLOAD_KEYS = {"name", "description", "requests", "server_args", "max_steps",
                 "max_seconds", "expect"}
EXPECT_KEYS = {"aborted", "vacuous"}
REQUEST_KEYS = {"rid", "prompt", "prompt_range", "max_new_tokens", "arrival", "turn_of",
                "stop_token_ids", "emit", "ignore_eos", "abort_at", "priority"}
# The ServerArgs switches under which SGLang reads a request's priority (without either
# it ignores the priority).
PRIORITY_SWITCHES = ("enable_priority_scheduling", "abort_on_priority_when_disabled")


class WorkloadError(ValueError):
    """A workload file or name is invalid."""


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    ``prompt`` is the request's own new tokens; for a later turn (``turn_of`` set) the
    prompt SGLang receives is the parent's prompt + the parent's output + ``prompt``.
    """

    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = 0
    turn_of: str | None = None
    stop_token_ids: tuple[int, ...] = ()
    # (output position, token) pairs the model-free forward emits, by position.
    emit: tuple[tuple[int, int], ...] = ()
    ignore_eos: bool = False
    abort_at: int | None = None  # step at which SGLang's AbortReq for it is sent
    priority: int | None = None

    def sampling(self) -> dict[str, Any]:
        """The ``SamplingParams`` keyword arguments this request sets (greedy)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": 0.0,
                "stop_token_ids": list(self.stop_token_ids) or None,
                "ignore_eos": self.ignore_eos}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named, ordered set of requests plus the server-arg overrides it needs."""

    name: str
    requests: tuple[RequestSpec, ...]
    description: str = ""
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_steps: int = 200
    # The hang limit (seconds without a message from the run), None: the caller's default.
    max_seconds: float | None = None
    # Declared expected outcomes: ``aborted`` (request ids), ``vacuous`` (bool).
    expect: dict[str, Any] = dataclasses.field(default_factory=dict)

    def scripted_tokens(self) -> dict[str, dict[int, int]]:
        """``{rid: {output position: token}}``: what the model-free forward emits where
        the workload's ``emit`` says (requests without a script are absent)."""
        return {spec.rid: dict(spec.emit) for spec in self.requests if spec.emit}

    def free_running(self) -> bool:
        """Whether every request's output is the model's own greedy continuation up to
        ``max_new_tokens``: no scripted token, stop list or abort cuts or shapes it (then
        a reference model's generation, e.g. mlx-lm's, is what the run must emit)."""
        return not any(spec.emit or spec.stop_token_ids or spec.abort_at is not None
                       for spec in self.requests)

    def expected_outcomes(self) -> dict[str, Any]:
        """``[expect]`` with the scripted aborts added to ``aborted``: an abort the
        workload sends is an outcome it means to produce. ``declared_aborted``: the ones
        ``[expect]`` names, which SGLang must abort (a scripted abort may come after its
        request finished)."""
        sent = [spec.rid for spec in self.requests if spec.abort_at is not None]
        declared = list(self.expect.get("aborted", []))
        aborted = declared + [rid for rid in sent if rid not in declared]
        outcomes = {**self.expect, "aborted": aborted} if aborted else dict(self.expect)
        if declared:
            outcomes["declared_aborted"] = declared
        return outcomes

    def request(self, rid: str) -> RequestSpec:
        for spec in self.requests:
            if spec.rid == rid:
                return spec
        raise KeyError(rid)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>",
                  validate: bool = True) -> "Workload":
        """A workload from TOML's (or :meth:`to_dict`'s) data, validated unless it comes
        from a validated one (``validate=False``: a run spec's, in the run's process)."""
        try:
            _require_known(raw, WORKLOAD_KEYS, "key", "the workload")
            requests = raw["requests"]
            if not isinstance(requests, (list, tuple)) or not all(isinstance(r, dict)
                                                                  for r in requests):
                raise WorkloadError(f"requests must be a list of [[requests]] tables, got "
                                    f"{requests!r}")
            for table in ("server_args", "expect"):
                if not isinstance(raw.get(table, {}), dict):
                    raise WorkloadError(f"[{table}] must be a table of key = value, got "
                                        f"{raw[table]!r}")
            if not isinstance(raw["name"], str):
                raise WorkloadError(f"name must be a string, got {raw['name']!r}")
            workload = cls(
                name=raw["name"],
                requests=tuple(_request_from_dict(r) for r in requests),
                description=str(raw.get("description", "")).strip(),
                server_args=dict(raw.get("server_args", {})),
                max_steps=raw.get("max_steps", 200),
                max_seconds=raw.get("max_seconds"),
                expect=dict(raw.get("expect", {})),
            )
        except WorkloadError as exc:
            raise WorkloadError(f"{source}: {exc}") from None
        except KeyError as exc:
            raise WorkloadError(f"{source}: invalid workload: missing field {exc}") from exc
        except (AttributeError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{source}: invalid workload ({exc})") from exc
        if validate:
            workload.validate(source)
        return workload

    def validate(self, source: str = "<workload>") -> None:
        """Reject what SGLang would misread: counts that are not integers (``1.5``,
        ``"3"`` and ``true`` included), negative arrivals, reserved token ids, bad turns."""
        _require_int(self.max_steps, "max_steps", source, minimum=1)
        if self.max_seconds is not None:
            require_seconds(self.max_seconds, f"{source}: max_seconds")
        if not self.requests:
            raise WorkloadError(f"{source}: no requests")
        rids = [r.rid for r in self.requests]
        if len(set(rids)) != len(rids):
            raise WorkloadError(f"{source}: duplicate request ids in {rids}")
        for spec in self.requests:
            where = f"{source}: request {spec.rid!r}"
            if spec.turn_of is not None and spec.turn_of not in rids[: rids.index(spec.rid)]:
                raise WorkloadError(
                    f"{where} is a turn of {spec.turn_of!r}, "
                    "which must be an earlier request of the workload")
            if spec.turn_of is None and not spec.prompt:
                raise WorkloadError(f"{where} has an empty prompt")
            for token in spec.prompt:
                _require_int(token, "prompt token", where)
            if any(t < FIRST_ORDINARY_TOKEN for t in spec.prompt):
                raise WorkloadError(f"{where} uses reserved ids < {FIRST_ORDINARY_TOKEN}")
            _require_int(spec.max_new_tokens, "max_new_tokens", where, minimum=1)
            _require_int(spec.arrival, "arrival", where, minimum=0)
            self._validate_bug_report_fields(spec, where, rids)

        self._validate_expect(source, rids)

    def _validate_bug_report_fields(self, spec: RequestSpec, where: str,
                                    rids: list[str]) -> None:
        """Stop tokens, the forward's script, sampling switches, aborts, priorities."""
        for token in spec.stop_token_ids:
            _require_int(token, "stop_token_ids entry", where, minimum=0)
        for position, token in spec.emit:
            _require_int(token, f"emit token (position {position})", where, minimum=0)
            if position >= spec.max_new_tokens:
                raise WorkloadError(
                    f"{where}: emit position {position} is past the request's output "
                    f"(positions 0..{spec.max_new_tokens - 1}, max_new_tokens "
                    f"{spec.max_new_tokens})")
        if not isinstance(spec.ignore_eos, bool):
            raise WorkloadError(f"{where}: ignore_eos must be true or false, got "
                                f"{spec.ignore_eos!r}")
        if spec.abort_at is not None:
            _require_int(spec.abort_at, "abort_at", where, minimum=spec.arrival)
            prefixed = [r for r in rids if r != spec.rid and r.startswith(spec.rid)]
            if prefixed:
                raise WorkloadError(
                    f"{where} has abort_at, but SGLang matches an abort by request-id "
                    f"prefix, so it would also abort {prefixed}; rename the requests")
        if spec.priority is not None:
            _require_int(spec.priority, "priority", where)
            if not any(self.server_args.get(k) is True for k in PRIORITY_SWITCHES):
                raise WorkloadError(
                    f"{where} has a priority, which SGLang ignores unless "
                    "enable_priority_scheduling = true is set under [server_args]")

    def _validate_expect(self, source: str, rids: list[str]) -> None:
        unknown = set(self.expect) - EXPECT_KEYS
        if unknown:
            raise WorkloadError(f"{source}: unknown [expect] key(s) {sorted(unknown)}; "
                                f"valid keys: {', '.join(sorted(EXPECT_KEYS))}")
        aborted = self.expect.get("aborted", [])
        if not isinstance(aborted, list) or not all(isinstance(r, str) for r in aborted):
            raise WorkloadError(f"{source}: [expect] aborted must be a list of request ids, "
                                f"got {aborted!r}")
        missing = [r for r in aborted if r not in rids]
        if missing:
            raise WorkloadError(f"{source}: [expect] aborted names unknown request(s) "
                                f"{missing}; the workload's requests: {rids}")
        if not isinstance(self.expect.get("vacuous", False), bool):
            raise WorkloadError(f"{source}: [expect] vacuous must be true or false, got "
                                f"{self.expect['vacuous']!r}")

    def check_vocabulary(self, vocab_size: int, source: str = "<workload>") -> None:
        """Every prompt, stop and scripted token id must be below the model's
        ``vocab_size``."""
        for spec in self.requests:
            for what, tokens in (("token ids", spec.prompt),
                                 ("stop_token_ids", spec.stop_token_ids),
                                 ("emit tokens", [t for _, t in spec.emit])):
                outside = [t for t in tokens if t >= vocab_size]
                if outside:
                    raise WorkloadError(
                        f"{source}: request {spec.rid!r} uses {what} {outside[:5]} outside "
                        f"the model's vocabulary (ids 0..{vocab_size - 1}, vocab_size "
                        f"{vocab_size})")


def _require_int(value: Any, field: str, where: str, minimum: int | None = None) -> None:
    """A count or id must be a real integer (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where}: {field} must be an integer, got {value!r} "
                            f"({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise WorkloadError(f"{where}: {field} must be >= {minimum}, got {value}")


def _request_from_dict(raw: dict[str, Any]) -> RequestSpec:
    """Field values are kept as written; :meth:`Workload.validate` checks their types."""
    rid = raw["rid"]
    if not isinstance(rid, str) or not rid:
        raise WorkloadError(f"a request's rid must be a non-empty string, got {rid!r}")
    _require_known(raw, REQUEST_KEYS, "field", f"request {rid!r}")
    if "prompt_range" in raw:
        if "prompt" in raw:
            raise WorkloadError(f"request {rid!r} has both prompt and prompt_range; give "
                                "one")
        bounds = raw["prompt_range"]
        if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
            raise WorkloadError(f"request {rid!r}: prompt_range must be [start, stop] (the "
                                f"prompt is the token ids start..stop-1), got {bounds!r}")
        for bound in bounds:
            _require_int(bound, "prompt_range", f"request {rid!r}")
        prompt = tuple(range(*bounds))
    else:
        prompt = _int_list(raw.get("prompt", ()), "prompt", rid)
    return RequestSpec(
        rid=rid,
        prompt=prompt,
        max_new_tokens=raw["max_new_tokens"],
        arrival=raw.get("arrival", 0),
        turn_of=raw.get("turn_of"),
        stop_token_ids=_int_list(raw.get("stop_token_ids", ()), "stop_token_ids", rid),
        emit=_emit_pairs(raw.get("emit", ()), rid),
        ignore_eos=raw.get("ignore_eos", False),
        abort_at=raw.get("abort_at"),
        priority=raw.get("priority"),
    )


def _require_known(raw: dict[str, Any], known: set[str], kind: str, where: str) -> None:
    """Refuse a key that is not one of ``known`` (a typo would silently take a default),
    naming the closest known one."""
    for key in sorted(set(raw) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise WorkloadError(f"{where}: unknown {kind} {key!r}{hint} (valid: "
                            f"{', '.join(sorted(known))})")


def _int_list(value: Any, field: str, rid: str) -> tuple:
    """A TOML array, kept as a tuple (its entries are checked by ``validate``)."""
    if not isinstance(value, (list, tuple)):
        raise WorkloadError(f"request {rid!r}: {field} must be a list of token ids, got "
                            f"{value!r}")
    return tuple(value)


def _emit_pairs(value: Any, rid: str) -> tuple[tuple[int, Any], ...]:
    """``emit`` as (position, token) pairs sorted by position: from a TOML table
    ``{3 = 7}`` (whose keys are strings) or from pairs (:meth:`Workload.to_dict`'s round
    trip). Positions are checked here, tokens by ``validate``."""
    where = f"request {rid!r}"
    if isinstance(value, dict):
        pairs = [(int(k) if isinstance(k, str) and k.removeprefix("-").isdigit() else k, t)
                 for k, t in value.items()]  # "-1" parses, to be refused as negative
    elif isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise WorkloadError(f"{where}: emit must be a table of output position = token, "
                            f"e.g. emit = {{ 3 = 2 }}, got {value!r}")
    for position, _ in pairs:
        _require_int(position, "emit position", where, minimum=0)
    positions = [p for p, _ in pairs]
    if len(set(positions)) != len(positions):
        raise WorkloadError(f"{where}: emit names a position twice: {positions}")
    return tuple(sorted(pairs))


def require_seconds(value: Any, what: str) -> float:
    """``value`` as a positive, finite number of seconds; :class:`WorkloadError` if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value < float("inf")):
        raise WorkloadError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def workload_names() -> list[str]:
    """Names of the shipped workloads (files under ``data/workloads/``)."""
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))


def load_workload(name_or_path: str | Path) -> Workload:
    """A shipped workload by name, or a workload file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = WORKLOAD_DIR / f"{name_or_path}.toml"
        if not path.exists():
            if Path(name_or_path).is_dir():
                raise WorkloadError(f"{name_or_path}: a directory, not a workload file")
            raise WorkloadError(
                f"unknown workload {str(name_or_path)!r}; "
                f"shipped workloads: {', '.join(workload_names())} (or a path to a .toml file)")
    elif not path.exists():
        raise WorkloadError(f"workload file not found: {path}")
    try:
        raw = tomllib.loads(read_user_file(path, "workload file", MAX_WORKLOAD_BYTES)
                            .decode("utf-8"))
    except UntrustedError as exc:
        raise WorkloadError(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                            f"offset {exc.start}); TOML files must be UTF-8") from exc
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the workload file ({exc.strerror})") from exc
    return Workload.from_dict(raw, source=str(path))
