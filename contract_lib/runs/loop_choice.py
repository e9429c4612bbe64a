"""Every command that takes loops checks them here, before any run: a name that is not a
registered loop, or a loop SGLang cannot run on this machine (``LoopSpec.unsupported``:
the pipeline and PD-multiplexing loops), is one line and exit 2, not a table of refused
runs."""

from __future__ import annotations

from typing import Iterable

from contract_lib import loops
from contract_lib.wire.protocol import RunSetupError


def runnable(names: Iterable[str], *, role: str | None = None) -> tuple[str, ...]:
    """``names``, each a registered loop that runs here (and, with ``role``, a
    PD-disaggregation loop of that role: ``prefill`` or ``decode``); else a
    :class:`RunSetupError` naming the first that is not."""
    chosen = tuple(names)
    for name in chosen:
        if name not in loops.LOOP_SPECS:
            raise RunSetupError(f"unknown loop {name!r}; valid loops: "
                                f"{', '.join(loops.names())}")
        why = loops.refusal(name)
        if why:
            raise RunSetupError(why)
        if role is not None and loops.spec(name).disaggregation != role:
            fits = [n for n, s in loops.LOOP_SPECS.items()
                    if s.disaggregation == role and not s.unsupported]
            raise RunSetupError(f"loop {name} is not a PD-disaggregation {role} loop; "
                                f"{role} loops: {', '.join(fits)}")
    return chosen
