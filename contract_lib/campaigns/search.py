"""Property-based search for the smallest workload that breaks the contract (Hypothesis).

A campaign first runs the smallest workload once (:func:`prepare`: what fails whatever
the workload, e.g. a patch that does not import, is an error before anything is
generated), then generates workloads (:mod:`contract_lib.campaigns.generation`), runs each through the real loop with
:func:`contract_lib.run`, and stops at the first *finding* (:func:`judge`): a clause
violated (with ``clause=N``, only clause N counts); a run that crashed, died or timed
out (``not-finished``); or output tokens unequal to the unpatched torch ``normal`` loop's
on the same workload (``tokens``: the model-free forward is a deterministic function of
the context, so every correct loop emits the same tokens for every request that
finished; :func:`~contract_lib.contract.outputs.same_tokens`). Hypothesis shrinks it to a
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

from hypothesis import (
    HealthCheck,
    Phase,
    Verbosity,
    given,
    reject,
    seed as hypothesis_seed,
    settings,
)
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Unsatisfiable

from contract_lib import loops

# The minimal workload's file and the generated workloads: re-exported here, where
# campaigns are run.
from contract_lib.campaigns.found import FOUND_DIR, to_toml, workload_size  # noqa: F401
from contract_lib.campaigns.generation import workloads
from contract_lib.contract import CLAUSES, Report, check, violation_message
from contract_lib.contract.outputs import same_tokens
from contract_lib.frames import Frames, run_title
from contract_lib.patches.builtin import PatchSpec, patch_spec
from contract_lib.paths import PROJECT_ROOT
from contract_lib.runs.harness import frames_or_raise, run, run_many
from contract_lib.runs.loop_choice import runnable
from contract_lib.sources.origin import Source, file_part, resolve, run_sglang
from contract_lib.verdict import loop_mismatch, setup_failed
from contract_lib.workloads import Workload

DATABASE_DIR = PROJECT_ROOT / ".cache" / "hypothesis-search"

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
    sglang: str | None = None  # a release or a source tree (None: the venv's SGLang)
    diffs: tuple[str, ...] = ()  # upstream diffs applied to it, in order
    generated: int = 0         # examples Hypothesis generated before the first finding
    #                            (repeats and discarded ones included; --budget bounds them)
    examples: int = 0          # distinct workloads run before the first finding
    runs: int = 0              # distinct workloads run in all (generation and shrinking)
    rejected: int = 0          # examples discarded (set-up error, vacuous)
    history: list[tuple[Workload, Finding]] = dataclasses.field(default_factory=list)
    found: tuple[Workload, Finding] | None = None
    setup_errors: list[str] = dataclasses.field(default_factory=list)
    # The SGLang resolved by :func:`prepare` (None: not yet).
    source: Source | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def slug(self) -> str:
        parts = [self.loop, (self.patch or "unpatched").replace(":", "-").replace("/", "-")]
        if self.clause:
            parts.append(f"clause-{self.clause}")
        return ".".join(parts) + file_part(self.sglang, self.diffs)

    def command(self) -> str:
        words = ["python -m contract_lib search", f"--loop {self.loop}"]
        words += [f"--patch {p}" for p in PatchSpec(self.patch or "").parts]
        words += [f"--sglang {self.sglang}"] if self.sglang else []
        words += [f"--diff {diff}" for diff in self.diffs]
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
        for rid, same in same_tokens(frames, reference).items():
            if not same:
                return Finding("tokens", f"request {rid}: {frames.loop} emitted "
                               f"{ours.get(rid)}, {REFERENCE_LOOP} emitted "
                               f"{theirs.get(rid)}", field="outputs")
    return None


def _discarded(frames: Frames, report: Report) -> str | None:
    """Why a generated run proves nothing either way (set-up error, another loop, vacuous);
    ``report``: its check."""
    if setup_failed(frames.meta):
        return _error_line(frames)
    mismatch = loop_mismatch(frames.meta)
    if mismatch:
        return mismatch
    if frames.status == "finished" and report.vacuity():
        return "vacuous"
    return None


# -- the campaign ----------------------------------------------------------------------

# The smallest workload: run once through the loop and its reference before anything is
# generated, so that what fails whatever the workload fails at once (:func:`prepare`).
PROBE = Workload.from_dict({"name": "set-up probe", "max_steps": 50, "requests": [
    {"rid": "a", "prompt": [100], "max_new_tokens": 1}]}, source="search's set-up probe")


def prepare(campaign: Campaign) -> Source:
    """Check a campaign before it generates anything, and resolve its SGLang (kept in
    ``campaign.source``): the loop, the clause, the budgets and the patches; the SGLang
    (a release installed on first use, a source tree checked, diffs applied); then one
    run of :data:`PROBE` through the loop and its reference, so that a patch that does
    not import or apply, a run that would enter another loop, or an SGLang that does not
    build a scheduler is an error at once. Raises a set-up error
    (:class:`RunSetupError`, :class:`PatchError`, :class:`SourceError`, ...) or
    :class:`SearchSetupError`."""
    runnable([campaign.loop])
    if campaign.clause is not None and campaign.clause not in CLAUSES:
        raise SearchSetupError(f"unknown clause {campaign.clause}; clauses: "
                               f"{', '.join(map(str, CLAUSES))}")
    if campaign.budget < 1 or campaign.shrink_budget < 0:
        raise SearchSetupError("the budget must be at least 1 and the shrink budget at "
                               "least 0")
    patch_spec(campaign.patch)  # an unknown patch or module
    campaign.source = resolve(campaign.sglang, campaign.diffs)
    for frames in frames_or_raise(run_many(
            [{"workload": PROBE, **job} for job in _jobs(campaign)], progress=False)):
        why = loop_mismatch(frames.meta) or (setup_failed(frames.meta) and _error_line(frames))
        if why:
            raise SearchSetupError(f"{run_title(frames.meta)} failed in set-up, so every "
                                   f"generated workload would: {why}")
    return campaign.source


def _error_line(frames: Frames) -> str:
    """A run's error as one line: its type and the first line of its message."""
    error = frames.error or {}
    return f"{error.get('type')}: {(str(error.get('message')).splitlines() or [''])[0]}"


def _jobs(campaign: Campaign) -> list[dict[str, Any]]:
    """The :func:`run` keywords of an example's runs: the loop, then (unless the loop is
    the unpatched reference itself) its torch reference, unpatched, on the same SGLang."""
    jobs = [{"loop": campaign.loop, "patch": campaign.patch, "cache": campaign.cache,
             **run_sglang(campaign.loop, campaign.source, campaign.sglang, campaign.diffs)}]
    if campaign.loop != REFERENCE_LOOP or campaign.patch:
        # A pinned loop's reference runs on the loop's release.
        sglang = (campaign.source if campaign.sglang or campaign.diffs
                  else _release(campaign.loop))
        jobs.append({"loop": REFERENCE_LOOP, "cache": campaign.cache, "sglang": sglang})
    return jobs


def search(campaign: Campaign, executor: Executor | None = None,
           progress: Callable[[str, int], None] | None = None,
           stop: threading.Event | None = None) -> Campaign:
    """Run ``campaign`` (its ``found`` is the minimal workload and finding, or None when
    the budget was spent without one). ``progress(phase, n)`` is called after every run
    (phase ``generate`` or ``shrink``); setting ``stop`` ends the campaign with a
    KeyboardInterrupt before its next run. Raises :class:`SearchSetupError` when no
    generated run got past set-up, :func:`prepare`'s errors when its probe fails."""
    if stop is not None and stop.is_set():
        raise KeyboardInterrupt("search stopped")
    if campaign.source is None:
        prepare(campaign)
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
    @given(workloads(turns=loops.spec(campaign.loop).disaggregation != loops.PREFILL))
    def probe(workload: Workload) -> None:
        if not locked:
            campaign.generated += 1
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
    ours, *others = [executor.submit(run, workload, **job) for job in _jobs(campaign)]
    theirs = others[0] if others else None
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
              f"{campaign.generated} examples generated, {campaign.examples} distinct "
              f"workloads run until the finding, {campaign.runs} in all (generation and "
              "shrinking)", ""]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{campaign.slug}.toml"
    path.write_text(to_toml(named, header))
    return path
