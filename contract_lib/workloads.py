"""Declarative workloads: which requests arrive at which loop iteration, with what prompt.

A workload is a TOML file under ``data/workloads/``::

    name = "two-turn"
    description = "..."
    max_steps = 120                # step budget; past it the run ends with status "timeout"

    [server_args]                  # optional ServerArgs overrides for this workload
    chunked_prefill_size = 32

    [[requests]]
    rid = "a"
    prompt_range = [20, 36]        # token ids 20..35 (or: prompt = [20, 21, ...])
    max_new_tokens = 12
    arrival = 0                    # loop iteration (step) at which it is fed in

    [[requests]]
    rid = "a2"
    turn_of = "a"                  # a later turn: a's prompt + a's output + prompt below
    prompt = [90, 91, 92]
    max_new_tokens = 4
    arrival = 20                   # earliest step; held until "a" has finished

    [expect]                       # optional: outcomes the workload means to produce
    aborted = ["a2"]               # requests SGLang is expected to abort (e.g. a prompt
                                   # longer than the model's context)
    vacuous = true                 # no clause is expected to be exercised

Without ``[expect]``, a request SGLang aborts or a run that exercises no clause makes
``check`` exit 4 (vacuous, :mod:`contract_lib.verdict`).

Token ids below 10 are reserved (the fake model never emits them; 2 is EOS).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from contract_lib.paths import WORKLOAD_DIR

# Token ids below this are reserved: the model-free next-token function and the tiny
# model never emit them (2 is EOS).
FIRST_ORDINARY_TOKEN = 10


EXPECT_KEYS = {"aborted", "vacuous"}


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


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named, ordered set of requests plus the server-arg overrides it needs."""

    name: str
    requests: tuple[RequestSpec, ...]
    description: str = ""
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_steps: int = 200
    # Declared expected outcomes: ``aborted`` (request ids), ``vacuous`` (bool).
    expect: dict[str, Any] = dataclasses.field(default_factory=dict)

    def request(self, rid: str) -> RequestSpec:
        for spec in self.requests:
            if spec.rid == rid:
                return spec
        raise KeyError(rid)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>") -> "Workload":
        try:
            requests = tuple(_request_from_dict(r) for r in raw["requests"])
            workload = cls(
                name=str(raw["name"]),
                requests=requests,
                description=str(raw.get("description", "")).strip(),
                server_args=dict(raw.get("server_args", {})),
                max_steps=raw.get("max_steps", 200),
                expect=dict(raw.get("expect", {})),
            )
        except WorkloadError as exc:
            raise WorkloadError(f"{source}: {exc}") from None
        except KeyError as exc:
            raise WorkloadError(f"{source}: invalid workload: missing field {exc}") from exc
        except (AttributeError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{source}: invalid workload ({exc})") from exc
        workload.validate(source)
        return workload

    def validate(self, source: str = "<workload>") -> None:
        """Reject what SGLang would misread: counts that are not integers (``1.5``,
        ``"3"`` and ``true`` included), negative arrivals, reserved token ids, bad turns."""
        _require_int(self.max_steps, "max_steps", source, minimum=1)
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

        self._validate_expect(source, rids)

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
        """Every prompt token id must be below the model's ``vocab_size``."""
        for spec in self.requests:
            outside = [t for t in spec.prompt if t >= vocab_size]
            if outside:
                raise WorkloadError(
                    f"{source}: request {spec.rid!r} uses token ids {outside[:5]} outside "
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
    rid = str(raw["rid"])
    if "prompt_range" in raw:
        start, stop = raw["prompt_range"]
        for bound in (start, stop):
            _require_int(bound, "prompt_range", f"request {rid!r}")
        prompt = tuple(range(start, stop))
    else:
        prompt = tuple(raw.get("prompt", ()))
    return RequestSpec(
        rid=rid,
        prompt=prompt,
        max_new_tokens=raw["max_new_tokens"],
        arrival=raw.get("arrival", 0),
        turn_of=raw.get("turn_of"),
    )


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
    elif path.is_dir():
        raise WorkloadError(f"{path}: a directory, not a workload file")
    try:
        with path.open("rb") as handle:
            raw = tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                            f"offset {exc.start}); TOML files must be UTF-8") from exc
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the workload file ({exc.strerror})") from exc
    return Workload.from_dict(raw, source=str(path))
