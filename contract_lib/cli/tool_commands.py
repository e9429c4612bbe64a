"""The tool commands: ``search`` (a smallest breaking workload), ``cache`` (the frame
cache), ``server`` (the warm servers)."""

from __future__ import annotations

import sys
from pathlib import Path

from contract_lib import loops
from contract_lib.cli.options import add_sglang_options
from contract_lib.contract import CLAUSE_SETS, CLAUSES
from contract_lib.patches.builtin import patch_spec
from contract_lib.runs.harness import RunSetupError
from contract_lib.verdict import Outcome


def cmd_search(args) -> int:
    from tqdm.auto import tqdm

    from contract_lib.campaigns.search import (
        FOUND_DIR,
        Campaign,
        SearchSetupError,
        prepare,
        search_many,
        workload_size,
        write_found,
    )

    if args.seeds < 1:
        raise RunSetupError("--seeds must be at least 1")
    patch = patch_spec(args.patch)
    campaigns = [Campaign(args.loop, patch, args.clause, args.budget, args.seed + k,
                          clauses=args.clauses, strict_known=args.strict_known,
                          shrink_budget=args.shrink_budget,
                          database=not args.no_database, cache=not args.no_cache,
                          sglang=args.sglang, diffs=tuple(args.diff or ()))
                 for k in range(args.seeds)]
    try:  # before the bar: what fails whatever the workload is one line, at once
        source = prepare(campaigns[0])
    except SearchSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Outcome.USAGE
    for campaign in campaigns[1:]:
        campaign.source = source
    bar = tqdm(total=args.budget * args.seeds, desc=f"search {args.loop}", unit="run",
               file=sys.stderr, leave=False)

    def progress(phase: str, _runs: int) -> None:
        bar.set_description(f"search {args.loop} ({phase})")
        bar.update(1)

    client = None
    try:
        executor = None
        if args.dask:
            from distributed import Client

            client = Client(args.dask)
            executor = client.get_executor()
        done = search_many(campaigns, executor, progress)
    except SearchSetupError as exc:
        bar.close()  # the error on a line of its own
        print(f"error: {exc}", file=sys.stderr)
        return Outcome.USAGE
    finally:
        bar.close()
        if client is not None:
            client.close()
    found = [c for c in done if c.found]
    for c in done:
        print(f"seed {c.seed}: " + (
            f"found {c.found[1].kind} after {c.generated} examples ({c.examples} distinct "
            f"workloads run), {c.runs} runs with shrinking" if c.found else
            f"nothing found in {c.generated} examples ({c.runs} distinct workloads run)")
            + f", {c.rejected} discarded")
    if not found:
        print(f"no finding on --loop {args.loop}{' --patch ' + patch if patch else ''} in "
              f"{sum(c.generated for c in done)} examples (--budget {args.budget}"
              f"{' per seed' if args.seeds > 1 else ''})")
        return Outcome.PASS
    best = min(found, key=lambda c: tuple(workload_size(c.found[0]).values()))
    path = write_found(best, args.out or FOUND_DIR)
    print(best.found[1].line)
    print(f"minimal workload written to {path}")
    return Outcome.VIOLATED


def cmd_cache(args) -> int:
    from contract_lib.runs import cache

    if args.action == "clear":
        try:
            removed = cache.clear()
        except cache.CacheDirError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"removed {removed} cached runs from {cache.cache_dir()}")
    else:
        print(cache.cache_dir())
    return 0


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def cmd_server(args) -> int:
    """``server status``: one line per warm server; ``server stop``: stop them all;
    ``server start``: start the servers of the venv's SGLang (or of each ``--sglang``)
    now, side by side, then print the status."""
    from contract_lib.runs import pool, servers

    directory = pool.server_dir()
    if args.action == "start" and (failed := _start_servers(args.sglang or [None])):
        return failed
    try:
        if args.action == "stop":
            stopped = servers.stop_all(directory)
            print(f"stopped {len(stopped)} warm server(s) in {directory}"
                  + "".join(f"\n  pid {s['pid']}: {s['runs_served']} runs served"
                            for s in stopped))
            return 0
        found = servers.statuses(directory)
    except pool.ServerUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Outcome.USAGE
    if not found:
        print(f"no warm server running in {directory}")
    for status in found:
        handle = pool.Server(directory, status["sglang_dir"])
        handle.identity = status["identity"]  # a tree's edits are judged by each run
        current = handle.fingerprint()
        state = ("retiring" if status["retiring"] else
                 "stale (SGLang's files or the library changed; replaced on the next run)"
                 if status["fingerprint"] != current else "current")
        askers = sorted({pid for pid in (status.get("requesters") or {}).values() if pid})
        idle = (f"busy, {len(status['running'])} running"
                + (f" (asked by pid {', '.join(map(str, askers))})" if askers else "")
                if status["running"] else
                f"exits in {_duration(status['idle_left_s'])} if idle")
        print(f"pid {status['pid']}: sglang {status['sglang_version']} from "
              f"{status['sglang_dir'] or 'the venv'}, up {_duration(status['uptime_s'])}, "
              f"{idle}, {status['runs_served']} runs served, {state}")
    return 0


def _start_servers(sglangs: list) -> int:
    """Start the server of each SGLang, side by side; 0, or 2 with one line per server
    that is not listening afterwards (or when servers are switched off)."""
    from contract_lib.runs import pool
    from contract_lib.sources.origin import resolve

    if not pool.enabled():
        print(f"error: warm servers are switched off ({pool.SERVER_SWITCH_ENV}=off); runs "
              "start cold, nothing to start", file=sys.stderr)
        return 2
    sources = [resolve(sglang) for sglang in sglangs]
    dirs, identities = [s.sglang_dir for s in sources], [s.identity or None for s in sources]
    servers = [pool.POOL.acquire(d, i) for d, i in zip(dirs, identities)]
    if None in servers:
        return 2  # the server directory cannot be used (acquire printed why)
    for thread in pool.prestart(dirs, identities):
        thread.join()
    down = [server for server in servers if server.ask(("status",)) is None]
    for server in down:
        print(f"error: the warm server for {server.label()} did not start "
              f"(log: {server.log_path})", file=sys.stderr)
    return 2 if down else 0


def register(commands) -> None:
    """Add ``search``, ``cache`` and ``server`` to the subcommands."""
    search_parser = commands.add_parser(
        "search", help="generate workloads until one breaks the contract, shrink it, write "
        "it to data/workloads/found/; exit 1 found, 0 none within the budget, 2 set-up error")
    search_parser.add_argument("--loop", required=True,
                               help=f"one of: {', '.join(loops.names())}")
    search_parser.add_argument("--patch", action="append", help="apply to the searched "
                               "loop's runs (repeatable); the torch reference stays unpatched")
    search_parser.add_argument("--clause", type=int, choices=sorted(CLAUSES), metavar="N",
                               help="count only violations of clause N (crashes and unequal "
                               "tokens still count)")
    search_parser.add_argument("--clauses", choices=CLAUSE_SETS, default="all",
                               help="the clause set checked, as for check (a known "
                               "upstream bug reproduced exactly is no finding, unless "
                               "--strict-known)")
    search_parser.add_argument("--strict-known", action="store_true", help="a catalogued "
                               "upstream bug reproduced exactly is a finding too")
    search_parser.add_argument("--budget", type=int, default=100,
                               help="examples to generate before giving up (default 100)")
    search_parser.add_argument("--shrink-budget", type=int, default=150,
                               help="runs allowed for shrinking a finding (default 150)")
    search_parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed")
    search_parser.add_argument("--seeds", type=int, default=1, help="independent campaigns "
                               "(seeds SEED, SEED+1, ...) run side by side")
    search_parser.add_argument("--dask", metavar="ADDRESS", help="run on this Dask "
                               "distributed scheduler (Client(ADDRESS).get_executor())")
    search_parser.add_argument("--no-database", action="store_true", help="ignore "
                               "Hypothesis' example database (.cache/hypothesis-search)")
    search_parser.add_argument("--out", type=Path, help="the folder to write the minimal "
                               "workload to (default: data/workloads/found)")
    search_parser.add_argument("--no-cache", action="store_true",
                               help="neither serve nor store runs in the frame cache")
    add_sglang_options(search_parser)
    search_parser.set_defaults(handler=cmd_search)
    cache_parser = commands.add_parser("cache", help="manage the frame cache")
    cache_parser.add_argument("action", choices=["clear", "path"])
    cache_parser.set_defaults(handler=cmd_cache)
    server_parser = commands.add_parser(
        "server", help="the warm servers (one per SGLang release, started on first use, "
        "exit when idle): status, stop them all, or start them ahead of the first run")
    server_parser.add_argument("action", choices=["status", "stop", "start"])
    server_parser.add_argument("--sglang", action="append", metavar="VERSION|PATH",
                               help="start: a release or source tree whose server to start "
                               "(repeatable; default: the venv's SGLang)")
    server_parser.set_defaults(handler=cmd_server)
