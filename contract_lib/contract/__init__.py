"""The per-step contract, checked on a run's frames.

A step that emits tokens must leave its clauses true when it ends (RFC #32833's five,
and this project's extensions: clause 2's ``decode_batch_idx``, 6 scheduling clocks
advanced, 7 request state retired). Each clause lives in its own module and is declared
once in the clause registry (:mod:`contract_lib.contract.registry`): number, name,
fields, SGLang readers, origin and when it is exercised. :func:`check` runs a clause set
(``"all"``, the default, or ``"rfc"``) and returns a :class:`Report`; the report, the
status table, the trace and the audit iterate the registry. ``docs/contract.md`` names
every field's readers and what goes wrong when it is stale.

Terms: a request is *live* at a step when it has a ``req_to_token`` row and has not
finished; ``kv_computed`` is the number of its positions whose KV a launched forward has
computed or queued (recorded at the model boundary). Besides the clauses, the report
carries SGLang's own KV pool conservation law (``available + evictable + protected +
uncached == total``, ``InvariantChecker``) evaluated at every step boundary.
"""

from contract_lib.contract import clocks, counters, idle, relay, retired, stamps  # noqa: F401,E402
from contract_lib.contract.base import (
                                        HOLDS,
                                        MASKED,
                                        NOT_EXERCISED,
                                        NOT_PRESENT,
                                        VIOLATED,
                                        VIOLATION_COLUMNS,
                                        ClauseResult,
                                        NotExercised,
                                        live_mask,
)
from contract_lib.contract.known import KnownMatch
from contract_lib.contract.registry import (
                                        CLAUSE_OF_FIELD,
                                        CLAUSE_SETS,
                                        CLAUSES,
                                        EXTENDED_FIELDS,
                                        EXTENSION_CLAUSES,
                                        EXTENSIONS,
                                        REGISTRY,
                                        RFC,
                                        Clause,
                                        clause,
                                        clause_checks,
                                        extend,
                                        origin,
                                        register,
                                        unregister,
)
from contract_lib.contract.report import (
                                        ABORTED_COLUMNS,
                                        POOL_ROW,
                                        ContractViolation,
                                        KnownUpstreamBug,
                                        Report,
                                        RunDidNotFinish,
                                        UntrustedVerdict,
                                        VacuousRun,
                                        aborted_requests,
                                        assert_contract,
                                        check,
                                        check_pool,
                                        violation_message,
)

# The clause modules, in clause order: importing one declares its clause.
from contract_lib.contract.slots import BAD_SLOT_STATES, SLOT_STATES, slot_states

__all__ = [
    "ABORTED_COLUMNS", "BAD_SLOT_STATES", "CLAUSE_OF_FIELD", "CLAUSE_SETS", "CLAUSES",
    "EXTENDED_FIELDS", "EXTENSION_CLAUSES", "EXTENSIONS", "HOLDS", "MASKED",
    "NOT_EXERCISED", "NOT_PRESENT", "POOL_ROW", "REGISTRY", "RFC", "SLOT_STATES", "VIOLATED",
    "VIOLATION_COLUMNS",
    "Clause", "ClauseResult", "ContractViolation", "KnownMatch", "KnownUpstreamBug",
    "NotExercised", "Report",
    "RunDidNotFinish", "UntrustedVerdict", "VacuousRun", "aborted_requests",
    "assert_contract", "check", "check_pool", "clause", "clause_checks", "extend",
    "live_mask", "origin", "register", "slot_states", "unregister",
    "violation_message",
]
