"""Differential effects audit: what the torch loops' steps write that a candidate loop
forgets.

The five clauses were written down after the bugs; the next bug will be in a field nobody
has listed. An audit runs one workload through both torch loops and one candidate loop
(default ``mlx``; ``loop=`` any other, e.g. a PD-disaggregation loop) with effects
recording on (:mod:`contract_lib.child.effects`), classifies each written field's
**cadence** per loop, and reports as a finding every field both torch loops write at
every launch that the candidate writes at another cadence or never, with the SGLang code
that reads it and whether a shipped clause covers it.

Cadences are measured over the run's launches of one mode (a step "writes" a field if
any write happened in that loop iteration): decode launches (where chained and fresh MLX
launches differ), or, for a PD prefill side (it launches no decode), extend launches.
``every decode launch`` (>= 90% of the steps with a decode launch), ``fresh decode
launches only`` (>= 90% of the steps with a fresh decode launch, <= 10% of those with only
a chained one: the MLX chain breaks), ``some decode launches``, ``outside decode
launches``, ``never`` (``extend`` for ``decode`` on a prefill side).

Only writes that change a value count (re-assigning the same object or an equal scalar,
e.g. ``prepare_for_decode`` clearing already-cleared prefill fields, is not an effect).
Noise is grouped, not listed: writes by object construction (``__init__``: the per-step
``ScheduleBatch.copy()`` that every overlap loop hands to ``process_batch_result``, new
``Req`` objects), timing-only fields (wall-clock stamps and durations), and loop-structure
fields written only by the event-loop function itself.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
from pathlib import Path

import pandas as pd

from contract_lib import loops
from contract_lib.contract import CLAUSE_OF_FIELD
from contract_lib.frames import Frames
from contract_lib.patches.builtin import PatchArg, patch_spec
from contract_lib.runs.harness import frames_or_raise, run_many
from contract_lib.runs.loop_choice import runnable
from contract_lib.sources.origin import Source, resolve
from contract_lib.verdict import Outcome, setup_failed
from contract_lib.wire.protocol import RunSetupError

# The effects audit compares the reference loops' cadences against one candidate's: by
# default the first default candidate (mlx).
REFERENCE_LOOPS = loops.reference_names()
CANDIDATE_LOOP = next(loop for loop in loops.default_names() if not loops.spec(loop).reference)


def launch_mode(candidate: str) -> str:
    """The launches cadences are measured over: ``extend`` for a PD prefill side (it
    launches no decode), else ``decode``."""
    return "extend" if loops.spec(candidate).disaggregation == loops.PREFILL else "decode"


class AuditRunFailed(RuntimeError):
    """An audit run did not finish, so there is nothing sound to compare: ``outcome`` is
    :attr:`Outcome.USAGE` (it failed in set-up) or :attr:`Outcome.NOT_FINISHED`;
    ``frames`` holds every run, with what each captured."""

    def __init__(self, message: str, outcome: Outcome, frames: dict[str, Frames]) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.frames = frames

# Fields a shipped clause already checks: each clause declares them
# (:data:`contract_lib.contract.CLAUSE_OF_FIELD`).
_TIMING = re.compile(r"(^|_)(ts|time|times|timestamp|latency|ns|us|ms|wall|monotonic|"
                     r"duration|elapsed|busy)(_|$)|_at$|_ts_|start_time", re.IGNORECASE)


def _constructing(location: str) -> bool:
    return location.endswith(":__init__") or location.endswith(" (new object)")


def cadence(effects: pd.DataFrame, launches: pd.DataFrame,
            mode: str = "decode") -> pd.DataFrame:
    """Per (object, field): the cadence of its writes in one run over its ``mode``
    launches, and where they come from."""
    decode = launches[launches["mode"] == mode]
    fresh = set(decode.loc[~decode["chained"].astype(bool), "step"])
    chained_only = set(decode.loc[decode["chained"].astype(bool), "step"]) - fresh
    launch_steps = fresh | chained_only
    rows = []
    for (obj, field), group in effects.groupby(["object", "field"], sort=True):
        steps = set(group["step"])
        at_launch = len(steps & launch_steps) / max(1, len(launch_steps))
        at_fresh = len(steps & fresh) / max(1, len(fresh))
        at_chained = (len(steps & chained_only) / len(chained_only)) if chained_only else None
        if at_launch >= 0.9:
            label = f"every {mode} launch"
        elif at_fresh >= 0.9 and at_chained is not None and at_chained <= 0.1:
            label = f"fresh {mode} launches only"
        elif steps & launch_steps:
            label = f"some {mode} launches"
        else:
            label = f"outside {mode} launches"
        rows.append({"object": obj, "field": field, "cadence": label,
                     "launch_steps_written": f"{len(steps & launch_steps)}/{len(launch_steps)}",
                     "locations": sorted(set(group["location"]))})
    return pd.DataFrame(rows, columns=["object", "field", "cadence", "launch_steps_written",
                                       "locations"])


@functools.lru_cache(maxsize=2)
def _sglang_sources(sglang_dir: Path | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every ``sglang/srt`` source file's lines, of the folder a run imports SGLang from
    (None: the venv's)."""
    if sglang_dir is None:
        spec = importlib.util.find_spec("sglang")
        root = Path(list(spec.submodule_search_locations)[0]) / "srt"
    else:
        root = Path(sglang_dir) / "sglang" / "srt"
    return tuple((str(path.relative_to(root)), tuple(path.read_text(errors="replace")
                                                     .splitlines()))
                 for path in sorted(root.rglob("*.py")))


def readers(field: str, limit: int = 4,
            sglang_dir: Path | None = None) -> tuple[int, list[str]]:
    """Sites in the SGLang of ``sglang_dir`` (None: the installed one) that read
    ``.field`` (not assignments to it): how many, and the first ``limit`` as
    ``path:line``."""
    name = field.removesuffix("[]")
    pattern = re.compile(rf"\.{re.escape(name)}\b(?!\s*(=[^=]|\+=|-=|\[[^\]]*\]\s*=[^=]))")
    sites = []
    for path, lines in _sglang_sources(sglang_dir):
        for number, line in enumerate(lines, 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                sites.append(f"{path}:{number}")
    return len(sites), sites[:limit]


def _noise_group(field: str, locations: list[str],
                 loop_functions: tuple[str, ...]) -> str | None:
    if locations and all(_constructing(loc) for loc in locations):
        return "object construction"
    if _TIMING.search(field):
        return "timing only"
    if locations and all(loc.split(":")[-1] in loop_functions for loc in locations):
        return "loop structure"
    return None


@dataclasses.dataclass
class Audit:
    """The cadence tables of every loop, the findings and the grouped noise."""

    workload: str
    patch: str | None
    cadences: dict[str, pd.DataFrame]
    findings: pd.DataFrame
    noise: pd.DataFrame
    sglang: str | None = None  # the runs' SGLang, as reports name it
    candidate: str = CANDIDATE_LOOP
    mode: str = "decode"  # the launches cadences are measured over (:func:`launch_mode`)

    @property
    def loops(self) -> tuple[str, ...]:
        """The audited loops: the references, then the candidate."""
        return (*REFERENCE_LOOPS, self.candidate)

    def text(self) -> str:
        patch = f" with patch {self.patch}" if self.patch else ""
        patch += f" on sglang {self.sglang}" if self.sglang else ""
        lines = [f"effects audit: {self.workload}{patch}: fields both torch loops write at "
                 f"every {self.mode} launch that {self.candidate} writes at another "
                 "cadence", ""]
        if self.findings.empty:
            lines.append("no findings")
        for r in self.findings.to_dict("records"):
            clause = (f"clause {int(r['clause'])}" if pd.notna(r["clause"])
                      else "no clause covers it")
            lines.append(f"{r['object']}.{r['field']}: " + " / ".join(
                f"{loop} {r[loop]}" for loop in self.loops) + f"; {clause}")
            lines.append(f"    written by {', '.join(r['written_by'])}")
            lines.append(f"    read at {r['readers']} sites, e.g. "
                         f"{', '.join(r['reader_sites'])}")
        if not self.noise.empty:
            lines.append("")
            lines.append("grouped (not findings):")
            for group, part in self.noise.groupby("group", sort=True):
                fields = ", ".join(f"{o}.{f}" for o, f in zip(part.object, part.field))
                lines.append(f"  {group} ({len(part)}): {fields}")
        return "\n".join(lines)


def compare(frames: dict[str, Frames], workload: str, patch: str | None = None,
            source: Source | None = None, candidate: str = CANDIDATE_LOOP) -> Audit:
    """Findings from audit runs of the same workload on the reference loops and
    ``candidate``; ``source``: their SGLang, whose code the readers are looked up in
    (None: the installed one)."""
    mode = launch_mode(candidate)
    audited = (*REFERENCE_LOOPS, candidate)
    loop_functions = tuple(loops.spec(loop).function for loop in audited)

    def part(frames_: Frames, constructing: bool) -> pd.DataFrame:
        effects = frames_.effects[frames_.effects["changed"] > 0]
        mask = effects["location"].map(_constructing)
        return cadence(effects[mask if constructing else ~mask], frames_.launches, mode)

    cadences = {loop: part(f, False) for loop, f in frames.items()}
    constructed = {loop: part(f, True) for loop, f in frames.items()}
    keyed = {loop: table.set_index(["object", "field"]) for loop, table in cadences.items()}
    findings, noise = [], []
    reference = keyed[REFERENCE_LOOPS[0]]
    for key, row in reference.iterrows():
        others = [keyed[loop] for loop in REFERENCE_LOOPS[1:]]
        every = f"every {mode} launch"
        if row["cadence"] != every or any(
                key not in other.index or other.loc[key, "cadence"] != every
                for other in others):
            continue
        measured = keyed[candidate]
        if key in measured.index and measured.loc[key, "cadence"] == every:
            continue
        obj, field = key
        locations = row["locations"]
        group = _noise_group(field, locations, loop_functions)
        record = {"object": obj, "field": field,
                  **{loop: (keyed[loop].loc[key, "cadence"] if key in keyed[loop].index
                            else "never") for loop in audited},
                  "written_by": locations}
        if group is not None:
            noise.append({**record, "group": group})
            continue
        count, sites = readers(field, sglang_dir=source.sglang_dir if source else None)
        findings.append({**record, "clause": CLAUSE_OF_FIELD.get(field), "readers": count,
                         "reader_sites": sites})
    # Fields the MLX loop writes only by constructing objects (its batch copies) where the
    # torch loops write them in place: grouped with the construction noise.
    for key, row in constructed[candidate].set_index(["object", "field"]).iterrows():
        if key not in keyed[candidate].index and any(
                key in keyed[loop].index for loop in REFERENCE_LOOPS) and not any(
                f["object"] == key[0] and f["field"] == key[1] for f in findings):
            noise.append({"object": key[0], "field": key[1], "group": "object construction",
                          "written_by": row["locations"]})
    finding_columns = ["object", "field", *audited, "clause", "readers", "reader_sites",
                       "written_by"]
    return Audit(workload=workload, patch=patch, cadences=cadences,
                 findings=pd.DataFrame(findings, columns=finding_columns),
                 noise=pd.DataFrame(noise, columns=["group", "object", "field", "written_by"]),
                 sglang=source.label if source else None, candidate=candidate, mode=mode)


def audit(workload: str = "two-turn", patch: PatchArg = None, progress: bool = True,
          sglang: str | Path | None = None, diff: list[str | Path] | None = None,
          loop: str = CANDIDATE_LOOP) -> Audit:
    """Run ``workload`` through both torch loops and the candidate ``loop`` with effects
    recording, and compare; on the SGLang ``sglang`` (a release or a source tree; None:
    the venv's) with ``diff`` applied, as for :func:`contract_lib.run`."""
    candidate, = runnable([loop])
    if loops.spec(candidate).reference:
        raise RunSetupError(f"loop {candidate} is a reference of the audit; audit a "
                            "candidate loop (e.g. mlx, or a disaggregation loop)")
    audited = (*REFERENCE_LOOPS, candidate)
    spec = patch_spec(patch)
    source = resolve(sglang, diff) if sglang or diff else None  # set-up errors first
    # A pinned candidate (omni: 0.5.22) is compared with the references on its release.
    where = source or loops.spec(candidate).sglang
    runs = run_many([{"workload": workload, "loop": name, "patch": spec, "audit": True,
                      **({"sglang": where} if where else {})}
                     for name in audited], progress=progress)
    runs = frames_or_raise(runs)
    by_loop = dict(zip(audited, runs))
    for frames in runs:
        if frames.status != "finished":
            error = frames.error or {}
            outcome = Outcome.USAGE if setup_failed(frames.meta) else Outcome.NOT_FINISHED
            raise AuditRunFailed(
                f"audit run {workload} on {frames.loop} {frames.status} after "
                f"{frames.meta.get('steps')} steps ({error.get('type')}: "
                f"{error.get('message')}); no audit from a run that did not finish",
                outcome, by_loop)
    return compare(by_loop, workload, spec, source, candidate)
