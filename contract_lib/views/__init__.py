"""Figures and text tables of the notebook suite, one module per subject.

Every figure takes :class:`~contract_lib.frames.Frames` and returns a
:class:`matplotlib.figure.Figure` built without pyplot, with a title, a subtitle saying
what to look at, labelled axes and a legend; several runs are drawn as side-by-side
panels, or one per row when they do not fit the width
(:func:`~contract_lib.views.style.panels`). Colours mean one thing in every figure
(:mod:`~contract_lib.views.style`). No module here checks a clause: they draw what
:mod:`contract_lib.contract` decides. Nothing reads a wall clock, so a figure is the same
for two runs of the same input.

- :mod:`.style`: the palette, panels, titles, legends, wrapping, font sizes;
- :mod:`.launch_figures`: fresh vs chained launches (overview);
- :mod:`.slot_figures`: clause 1, ``req_to_token`` rows;
- :mod:`.counter_figures`: clause 2, counter drift and radix reuse;
- :mod:`.stamp_figures`: clause 3; :mod:`.relay_figures`: clause 4;
  :mod:`.idle_figures`: clause 5;
- :mod:`.catalog_tables`: clause table, frames around a step, crash summary, bug cards
  and the bug catalogue; :mod:`.text`: the per-step table;
- :mod:`.triage`: where to look first, one step of one request, the clause's own view;
- :mod:`.extension_figures`: clauses 6 and 7, and clause 2 under memory pressure;
- :mod:`.audit_figures`: the effects audit; :mod:`.kvpool_figures`: the real MLX
  runner's KV pool;
- :mod:`.comparison`: a run beside its references (clause statuses, later turns);
- :mod:`.history_figures`: clause x release; :mod:`.history_tables`: each July bug per
  release;
- :mod:`.pair_figures`: one request across a PD pair's prefill and decode sides;
- :mod:`.notebook`: the set-up cell, the verdict line, a parameterised notebook's run.
"""

from contract_lib.views.audit_figures import audit_cadences, audit_table, beyond_rfc_text
from contract_lib.views.catalog_tables import (
    bug_card,
    catalog_table,
    crash_summary,
    frames_around,
    report_table,
    text_table,
)
from contract_lib.views.comparison import clause_comparison, later_turns
from contract_lib.views.counter_figures import counter_drift, radix_reuse, radix_reuse_table
from contract_lib.views.extension_figures import (
    clock_table,
    memory_pressure,
    memory_table,
    retired_lanes,
    scheduling_clock,
)
from contract_lib.views.history_figures import clause_history
from contract_lib.views.history_tables import (
    kv_history,
    read_against_measured,
    shutdown_history,
    stamp_history,
)
from contract_lib.views.idle_figures import idle_predicate
from contract_lib.views.kvpool_figures import (
    damage_by_workload,
    damage_summary,
    damage_table,
    kv_pool_verdicts,
    kv_writes,
    same_tables,
    token_table,
)
from contract_lib.views.launch_figures import launch_kinds, launch_timeline
from contract_lib.views.notebook import (
    Stop,
    check_switches,
    checked_run,
    md,
    setup,
    verdict_line,
)
from contract_lib.views.pair_figures import pair_journey
from contract_lib.views.relay_figures import relay_events
from contract_lib.views.slot_figures import SLOT_COLOURS, slot_grid, slot_rows
from contract_lib.views.stamp_figures import stamps_table, step_stamps
from contract_lib.views.style import panels, run_label, wrap
from contract_lib.views.triage import (
    clause_view,
    first_violation,
    recorded_summary,
    step_explorer,
    step_figure,
    step_snapshot,
    triage_focus,
)

__all__ = [
    "SLOT_COLOURS", "Stop", "audit_cadences", "audit_table", "beyond_rfc_text", "bug_card",
    "catalog_table", "check_switches", "checked_run", "clause_comparison",
    "clause_history", "clause_view", "clock_table", "counter_drift", "crash_summary",
    "damage_by_workload", "damage_summary", "damage_table", "first_violation",
    "frames_around", "idle_predicate", "kv_history", "kv_pool_verdicts", "kv_writes",
    "later_turns", "launch_kinds", "launch_timeline", "md", "memory_pressure",
    "memory_table", "pair_journey", "panels", "radix_reuse", "radix_reuse_table",
    "read_against_measured", "recorded_summary", "relay_events", "report_table",
    "retired_lanes", "run_label", "same_tables", "scheduling_clock", "setup",
    "shutdown_history", "slot_grid", "slot_rows", "stamp_history", "stamps_table",
    "step_explorer", "step_figure", "step_snapshot", "step_stamps", "text_table",
    "token_table", "triage_focus", "verdict_line", "wrap",
]
