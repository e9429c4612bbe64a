"""Property-based search for the smallest workload that breaks the contract (Hypothesis).

A campaign generates workloads (:func:`workloads`), runs each through the real loop with
:func:`contract_lib.run`, and stops at the first *finding* (:func:`judge`): a clause
violated (with ``clause=N``, only clause N counts); a run that crashed, died or timed
out (``not-finished``); or output tokens unequal to the unpatched torch ``normal`` loop's
on the same workload (``tokens``: the model-free forward is a deterministic function of
the context, so every correct loop emits the same tokens). Hypothesis shrinks it to a
minimal workload with the same kind and clause; :func:`write_found` saves it as TOML. A
run SGLang rejects in set-up, or a vacuous one, is discarded (``hypothesis.reject``).

Runs go through a :class:`concurrent.futures.Executor` (default: a local thread pool over
:func:`run`; for a cluster, ``distributed.Client(...).get_executor()``). Shrinking is
sequential; what parallelises is an example's two runs (the loop and its torch
reference) and independent campaigns (several seeds, :func:`search_many`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import strategies as st
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Unsatisfiable

from contract_lib import loops
from contract_lib.contract import Report, check, violation_message
from contract_lib.frames import Frames
from contract_lib.harness import run
from contract_lib.patches import PatchSpec, patch_spec
from contract_lib.verdict import loop_mismatch, setup_failed
from contract_lib.workloads import Workload
# The minimal workload's file: re-exported here, where campaigns are run.
from contract_lib.found import FOUND_DIR, to_toml, workload_size  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DATABASE_DIR = ROOT / ".cache" / "hypothesis-search"

# Deterministic policies only ("random" would make frames differ between runs);
# "routing-key" needs routing keys the workload format does not have.
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")
MAX_REQUESTS, MAX_NEW_TOKENS = 4, 24
MAX_OWN_PROMPT, MAX_PREFIX = 48, 32  # tokens: a request's own prompt, the shared prefix
MAX_ARRIVAL = 12                     # loop iterations
REFERENCE_LOOP = loops.reference_names()[0]  # the first reference loop (normal)
# A campaign whose first runs all fail in set-up (a patch that does not apply, a loop
# mismatch) is a set-up error, not a search.
SETUP_PROBES = 3


class SearchSetupError(ValueError):
    """The campaign cannot run: every generated run failed in set-up, or bad arguments."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """What a run shows: ``kind`` is ``violation``, ``not-finished`` or ``tokens``."""

    kind: str
    line: str
    clause: int | None = None
    field: str | None = None
    step: int | None = None

    @property
    def signature(self) -> tuple[str, int | None]:
        """What shrinking must preserve: the kind and the clause."""
        return (self.kind, self.clause)


@dataclasses.dataclass
class Campaign:
    """One search: its settings and, once run, what it found."""

    loop: str
    patch: str | None = None
    clause: int | None = None
    budget: int = 100
    seed: int = 0
    clauses: str = "all"       # the clause set checked: "all" or "rfc"
    strict_known: bool = False  # a catalogued upstream bug reproduced exactly is a finding
    shrink_budget: int = 150   # runs allowed after the first finding
    database: bool = True
    cache: bool = True
    examples: int = 0          # examples generated (and run) before the first finding
    runs: int = 0              # workloads run in all (generation and shrinking)
    rejected: int = 0          # examples discarded (set-up error, vacuous)
    history: list[tuple[Workload, Finding]] = dataclasses.field(default_factory=list)
    found: tuple[Workload, Finding] | None = None
    setup_errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def slug(self) -> str:
        parts = [self.loop, (self.patch or "unpatched").replace(":", "-").replace("/", "-")]
        if self.clause:
            parts.append(f"clause-{self.clause}")
        return ".".join(parts)

    def command(self) -> str:
        words = ["python -m contract_lib search", f"--loop {self.loop}"]
        words += [f"--patch {p}" for p in PatchSpec(self.patch or "").parts]
        if self.clause:
            words.append(f"--clause {self.clause}")
        if self.strict_known:
            words.append("--strict-known")
        if not self.database:
            words.append("--no-database")
        return " ".join(words + [f"--budget {self.budget}", f"--seed {self.seed}"])


class _SetupAbort(BaseException):
    """Raised inside the Hypothesis test to end the campaign at once (not an Exception,
    so Hypothesis does not take it for a failing example and shrink it)."""


class _Found(Exception):
    """Raised inside the Hypothesis test for a finding (the failing example)."""

    def __init__(self, workload: Workload, finding: Finding) -> None:
        super().__init__(finding.line)
        self.workload, self.finding = workload, finding


# -- generation ------------------------------------------------------------------------


# One request's choices: (turn, shared, own prompt length, max_new_tokens, arrival).
# ``turn`` 0 is a first turn; k > 0 makes request i a later turn of request (k-1) % i.
_REQUEST = st.tuples(st.integers(0, MAX_REQUESTS - 1), st.booleans(),
                     st.integers(0, MAX_OWN_PROMPT), st.integers(1, MAX_NEW_TOKENS),
                     st.integers(0, MAX_ARRIVAL))


@st.composite
def workloads(draw: Callable[[st.SearchStrategy], Any]) -> Workload:
    """A valid workload (ids 10..291, every context well inside 1024 tokens) and server
    args that keep SGLang in the loop asked for. Requests are a list, so shrinking can
    delete any of them; every choice shrinks towards "simpler": fewer requests, shorter
    prompts, arrival 0, no turn, no shared prefix, no server-arg override."""
    prefix = tuple(range(10, 10 + draw(st.integers(0, MAX_PREFIX))))
    raw = draw(st.lists(_REQUEST, min_size=1, max_size=MAX_REQUESTS))
    requests: list[dict[str, Any]] = []
    context: dict[str, int] = {}  # rid -> longest context (prompt + output), tokens
    for index, (turn, shared, own, new, arrival) in enumerate(raw):
        rid = "abcd"[index]
        turn_of = requests[(turn - 1) % index]["rid"] if turn and index else None
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


# -- judging ---------------------------------------------------------------------------


def judge(frames: Frames, reference: Frames | None, clause: int | None,
          clauses: str = "all", report: Report | None = None) -> Finding | None:
    """The finding a run shows, or None. ``reference``: the unpatched torch normal loop on
    the same workload (None: no token comparison). ``clauses``: the clause set checked
    (``all`` or ``rfc``); ``report``: that check, when the caller has it already. A
    clause whose violations are exactly a catalogued upstream bug's (``Report.known``,
    e.g. the torch loops' own clause 6) is not a finding: it is known, unless the
    report was made with ``strict_known``."""
    report = report if report is not None else check(frames, clauses)
    for number, result in report.failing().items():
        if clause is not None and number != clause:
            continue
        first = result.first()
        return Finding("violation", violation_message(first), number, first["field"],
                       int(first["step"]))
    if frames.status != "finished":
        error = frames.error or {}
        return Finding("not-finished", f"the run {frames.status} after "
                       f"{frames.meta.get('steps')} steps: {error.get('type')}: "
                       f"{error.get('message')}", step=frames.meta.get("steps"))
    if reference is not None and reference.status == "finished":
        ours, theirs = frames.output_tokens(), reference.output_tokens()
        for rid in sorted(set(ours) | set(theirs)):
            if ours.get(rid) != theirs.get(rid):
                return Finding("tokens", f"request {rid}: {frames.loop} emitted "
                               f"{ours.get(rid)}, {REFERENCE_LOOP} emitted "
                               f"{theirs.get(rid)}", field="outputs")
    return None


def _discarded(frames: Frames, report: Report) -> str | None:
    """Why a generated run proves nothing either way (set-up error, another loop, vacuous);
    ``report``: its check."""
    if setup_failed(frames.meta):
        error = frames.error or {}
        return f"{error.get('type')}: {error.get('message')}"
    mismatch = loop_mismatch(frames.meta)
    if mismatch:
        return mismatch
    if frames.status == "finished" and report.vacuity():
        return "vacuous"
    return None


# -- the campaign ----------------------------------------------------------------------


def search(campaign: Campaign, executor: Executor | None = None,
           progress: Callable[[str, int], None] | None = None,
           stop: threading.Event | None = None) -> Campaign:
    """Run ``campaign`` (its ``found`` is the minimal workload and finding, or None when
    the budget was spent without one). ``progress(phase, n)`` is called after every run
    (phase ``generate`` or ``shrink``); setting ``stop`` ends the campaign with a
    KeyboardInterrupt before its next run. Raises :class:`SearchSetupError` when no
    generated run got past set-up."""
    patch_spec(campaign.patch)  # an unknown patch is a usage error before any run
    own = executor is None
    executor = executor or ThreadPoolExecutor(max_workers=2)
    memo: dict[str, Finding | str | None] = {}
    locked: list[tuple[str, int | None]] = []

    def evaluate(workload: Workload) -> Finding | str | None:
        key = hashlib.sha256(repr(workload.to_dict()).encode()).hexdigest()
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt("search stopped")
        if key not in memo:
            if locked and campaign.runs - campaign.examples >= campaign.shrink_budget:
                return None  # shrink budget spent: unknown candidates count as passing
            memo[key] = _evaluate(campaign, workload, executor)
            campaign.runs += 1
            if len(campaign.setup_errors) == campaign.runs == SETUP_PROBES:
                raise _SetupAbort(f"the first {SETUP_PROBES} generated runs on --loop "
                                  f"{campaign.loop} all failed in set-up; the first: "
                                  f"{campaign.setup_errors[0]}")
            if progress:
                progress("shrink" if locked else "generate", campaign.runs)
        return memo[key]

    @settings(max_examples=campaign.budget, deadline=None, print_blob=False,
              verbosity=Verbosity.quiet,
              database=(DirectoryBasedExampleDatabase(DATABASE_DIR / campaign.slug)
                        if campaign.database else None),
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
              phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink))
    @hypothesis_seed(campaign.seed)
    @given(workloads())
    def probe(workload: Workload) -> None:
        outcome = evaluate(workload)
        if isinstance(outcome, str):
            campaign.rejected += 1
            reject()
        if outcome is None:
            return
        if not locked:
            locked.append(outcome.signature)
            campaign.examples = campaign.runs
        if outcome.signature == locked[0]:
            if not campaign.history or campaign.history[-1][0] != workload:
                campaign.history.append((workload, outcome))
            raise _Found(workload, outcome)

    try:
        probe()
    except _Found as found:
        campaign.found = (found.workload, found.finding)
    except _SetupAbort as abort:
        raise SearchSetupError(str(abort)) from None
    except Unsatisfiable:
        first = campaign.setup_errors[0] if campaign.setup_errors else "every run vacuous"
        raise SearchSetupError(f"no generated workload got a verdict on --loop "
                               f"{campaign.loop}: {first}") from None
    finally:
        if own:
            executor.shutdown(wait=True)
    if campaign.found is None:
        campaign.examples = campaign.runs
    return campaign


def _evaluate(campaign: Campaign, workload: Workload,
              executor: Executor) -> Finding | str | None:
    """Run the loop (and its torch reference, concurrently) and judge; a string says why
    the example is discarded."""
    kwargs = {"patch": campaign.patch, "cache": campaign.cache}
    ours = executor.submit(run, workload, campaign.loop, **kwargs)
    needs_reference = campaign.loop != REFERENCE_LOOP or campaign.patch
    theirs = (executor.submit(run, workload, REFERENCE_LOOP, cache=campaign.cache,
                              sglang=_release(campaign.loop)) if needs_reference else None)
    frames = ours.result()
    report = check(frames, campaign.clauses,  # once, while the reference still runs
                   campaign.strict_known)
    reference = theirs.result() if theirs else None
    why = _discarded(frames, report)
    if why:
        if why != "vacuous":
            campaign.setup_errors.append(why)
        return why
    return judge(frames, reference, campaign.clause, campaign.clauses, report)


def _release(loop: str) -> str | None:
    """The SGLang release a loop runs on (the reference runs on the same one)."""
    return loops.spec(loop).sglang if loop in loops.LOOP_SPECS else None


def search_many(campaigns: list[Campaign], executor: Executor | None = None,
                progress: Callable[[str, int], None] | None = None) -> list[Campaign]:
    """Independent campaigns (e.g. several seeds) side by side, one thread each, their
    runs through the one ``executor``: the part of a search that parallelises."""
    if len(campaigns) == 1:
        return [search(campaigns[0], executor, progress)]
    own = executor is None
    executor = executor or ThreadPoolExecutor(max_workers=2 * len(campaigns))
    stop = threading.Event()
    threads = ThreadPoolExecutor(max_workers=len(campaigns))
    try:
        return list(threads.map(lambda c: search(c, executor, progress, stop), campaigns))
    except KeyboardInterrupt:  # Ctrl-C: every campaign stops before its next run
        stop.set()
        raise
    finally:
        threads.shutdown(wait=True, cancel_futures=True)
        if own:
            executor.shutdown(wait=True)


def write_found(campaign: Campaign, directory: Path = FOUND_DIR) -> Path:
    """Save the campaign's minimal workload as ``<directory>/<slug>.toml`` with a header
    stating the command, the finding and its line."""
    workload, finding = campaign.found
    named = dataclasses.replace(workload, name=campaign.slug)
    where = ", ".join(f"{k} {v}" for k, v in (("clause", finding.clause),
                      ("field", finding.field), ("step", finding.step)) if v is not None)
    header = [f"found by: {campaign.command()}",
              f"finding: {finding.kind}{f' ({where})' if where else ''}",
              " ".join(finding.line.split()),
              f"{campaign.examples} examples tried, {campaign.runs} workloads run in all "
              "(generation and shrinking)", ""]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{campaign.slug}.toml"
    path.write_text(to_toml(named, header))
    return path
