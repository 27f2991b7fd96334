"""``zerostall ls`` and ``zerostall prune``: the checkpoints under a root, and retention by hand.

Both read the root through :mod:`zerostall.roots.root` and decide retention with the manager's own
rules (:func:`zerostall.roots.root.retained`), so what ``ls`` says a rule keeps is what ``prune`` keeps.
Incremental checkpoints share data files: ``ls`` shows each one's bytes that no other refers to,
those others refer to, and those it refers to; ``prune`` deletes through the root, which keeps
what others still refer to as retained data, and removes retained data nobody refers to any more.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import click
from rich.filesize import decimal as human_bytes
from rich.table import Column, Table

from ..roots.retention import RetentionPolicy, numeric_metrics
from ..roots.described import COMMITTED, CORRUPT, RETAINED, CheckpointInfo, describe
from ..roots.root import SUPERSEDED_NAME, CheckpointRoot, looks_like_checkpoint, retained
from ..roots.sharing import referenced, refs_set_aside
from ..storage import storage_for
from ..storage.location import few
from ..storage.local import LocalStorage
from ..tiers.local import DROPPED, INCOMING, step_folders

from .common import (EXIT_STATUSES, FAILED, USAGE, Failure, cli, clip, console, format_time, print_json,
                     refuse_live_writer, reported_errors)


@dataclass
class Listing(CheckpointInfo):
    """One row of ``zerostall ls``: a checkpoint as the root lists it, the rules that keep it, and
    whether ``latest`` names it."""

    kept_by: list[str] = field(default_factory=list)
    latest: bool = False
    unique_bytes: int = 0
    """Its own data files that no other checkpoint of the root refers to."""
    shared_bytes: int = 0
    """Its own data files that other checkpoints of the root refer to (kept while they do)."""

    def to_json(self) -> dict[str, Any]:
        """The row as ``--json`` prints it (the location under the key ``path``)."""
        row = asdict(self)
        row["path"] = row.pop("location")
        return row


def open_root(root: str) -> CheckpointRoot:
    """The checkpoint root at ``root`` (exit 2 when there is no such directory)."""
    storage = storage_for(root)
    if not storage.exists():
        raise Failure(f"no such directory: {root}", USAGE)
    return CheckpointRoot(storage)


def format_metrics(metrics: dict[str, Any]) -> str:
    """``loss=0.412 acc=0.91``: numbers to 4 significant digits, other values clipped."""
    parts = []
    for key, value in metrics.items():
        text = f"{value:.4g}" if isinstance(value, float) else clip(str(value), 20)
        parts.append(f"{key}={text}")
    return " ".join(parts) or "-"


def retention_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The rule options shared by ``ls`` and ``prune`` (those of CheckpointManager)."""
    options = [
        click.option("--keep-last", type=click.IntRange(min=1), help="Keep the K newest steps."),
        click.option("--keep-every", type=click.IntRange(min=1), help="Keep the steps divisible by N."),
        click.option("--keep-best", type=click.IntRange(min=1), help="Keep the K best steps by --metric."),
        click.option("--metric", help="The metric --keep-best ranks by (from the manifest's metrics)."),
        click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True,
                     help="Whether the best --metric is the smallest or the largest."),
        click.option("--keep-time-interval", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
                     help="Keep one checkpoint each time at least SECONDS passed since the last one kept."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def make_policy(keep_last: int | None, keep_every: int | None, keep_best: int | None, metric: str | None,
                mode: str, keep_time_interval: float | None) -> RetentionPolicy:
    """The retention policy of the rule options (exit 2 on an inconsistent combination)."""
    if metric is not None and keep_best is None:
        raise Failure("--metric is only used with --keep-best", USAGE)
    try:
        return RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, metric=metric,
                               mode=mode, keep_time_interval=keep_time_interval)
    except ValueError as exc:
        raise Failure(str(exc).replace("keep_best needs a metric", "--keep-best needs --metric"), USAGE) from exc


def apply_retention(rows: list[Listing], infos: list[CheckpointInfo], policy: RetentionPolicy,
                    latest: str | None) -> None:
    """Fill ``kept_by`` of the committed rows with a step, exactly as ``prune`` decides: the
    manager's rules, with the step ``latest`` names pinned (a job may be resuming from it)."""
    steps = [i.step for i in infos if i.status == COMMITTED and i.step is not None]
    pinned = [i.step for i in infos if i.name == latest and i.step is not None and i.step != max(steps, default=None)]
    reasons = retained(infos, policy, pinned=pinned)
    for r in rows:
        r.kept_by = reasons.get(r.name, [])


def check_metric(rows: list[Listing], policy: RetentionPolicy) -> str | None:
    """A message when --keep-best ranks by a metric that no committed checkpoint has (a typo?)."""
    if policy.keep_best is None:
        return None
    committed = [r for r in rows if r.status == COMMITTED and r.step is not None]
    if not committed or any(policy.metric in numeric_metrics(r.metrics) for r in committed):
        return None
    known = sorted({k for r in committed for k in numeric_metrics(r.metrics)})
    return (f"no committed checkpoint has the metric {policy.metric!r} "
            f"(metrics found: {', '.join(known) if known else 'none'})")


def scan(root: CheckpointRoot, policy: RetentionPolicy, *, include_root: bool) -> list[Listing]:
    """The checkpoints in ``root``'s immediate subdirectories (and ``root`` itself), sorted by step,
    the one ``latest`` names marked, each with the rules that keep it and the bytes it shares."""
    infos = root.scan(include_self=include_root)
    rows = [Listing(**asdict(info)) for info in infos]
    latest = root.read_latest()
    for r in rows:
        r.latest = latest is not None and r.name == latest and r.location != root.location
    apply_retention(rows, infos, policy, latest)
    users = referrers(root, rows)
    for r in rows:
        r.shared_bytes = still_used(r, users)
        r.unique_bytes = r.bytes - r.shared_bytes
    files = {r.name: r.files for r in rows}
    for r in rows:
        gone = [f"{name} of {tag}" for name, tag in r.refs.items() if name not in files.get(tag, {})]
        if r.status == COMMITTED and gone:  # deleted by hand: a load of it would fail
            r.status, r.error = CORRUPT, f"refers to data files that are gone ({few(gone)})"
    return rows


def referrers(root: CheckpointRoot, rows: list[Listing], gone: Collection[str] = ()) -> dict[str, set[str]]:
    """The data files of each checkpoint (by name) that the committed ones of ``rows`` not named in
    ``gone`` refer to, or those set aside under ``root`` (as :meth:`CheckpointRoot.delete` counts them)."""
    return referenced([r.refs for r in rows if r.status == COMMITTED and r.name not in gone]
                      + refs_set_aside(root.child(SUPERSEDED_NAME)))


def still_used(row: Listing, users: dict[str, set[str]]) -> int:
    """The bytes of ``row``'s own (or retained) data files that ``users`` refer to."""
    used = users.get(row.name, set())
    return sum(size for name, size in row.files.items() if name in used)


def shares(rows: list[Listing]) -> bool:
    """Whether any checkpoint listed shares data with another (incremental saves) or is retained data."""
    return any(r.shared_bytes or r.referenced_bytes or r.status == RETAINED for r in rows)


@cli.command(epilog=EXIT_STATUSES)
@click.argument("root")
@retention_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def ls(root: str, keep_last: int | None, keep_every: int | None, keep_best: int | None, metric: str | None,
       mode: str, keep_time_interval: float | None, as_json: bool) -> None:
    """List the checkpoints in ROOT (ROOT itself and its immediate subdirectories).

    The "kept by" column names the rules that keep each committed checkpoint, with the rule
    options given (the same as prune's), or with none: every checkpoint is kept ("all").
    """
    with reported_errors():
        checkpoints = open_root(root)
    policy = make_policy(keep_last, keep_every, keep_best, metric, mode, keep_time_interval)
    with reported_errors():
        rows = scan(checkpoints, policy, include_root=True)
        latest = checkpoints.read_latest()
    warning = check_metric(rows, policy)
    if warning:
        console(stderr=True).print(f"warning: {warning}")
    copies = [] if rows else node_copies(checkpoints)  # a local tier's node directory holds no checkpoint
    if as_json:
        print_json({"root": checkpoints.location, "latest": latest, "checkpoints": [r.to_json() for r in rows]}
                   | ({"local_tier": copies} if copies else {}))
        return
    if copies:
        show_node_copies(copies)
        return
    if not rows:
        console(stderr=True).print(f"no checkpoints in {checkpoints.location}")
        return
    sharing = shares(rows)  # the columns of shared data only where there is some: as before otherwise
    bytes_columns = [Column(c, justify="right") for c in ("size", *(("unique", "shared", "refers to") if sharing
                                                                    else ()))]
    table = Table("name", Column("step", justify="right"), "status", *bytes_columns, "created", "metrics", "kept by",
                  "latest")
    for r in rows:
        status = r.status if r.error is None else f"{r.status}: {r.error}"
        step = "-" if r.step is None else str(r.step)
        kept_by = ", ".join(r.kept_by) or "-"
        sizes = [r.bytes, *((r.unique_bytes, r.shared_bytes, r.referenced_bytes) if sharing else ())]
        table.add_row(r.name, step, status, *map(human_bytes, sizes), format_time(r.created),
                      format_metrics(r.metrics) if r.status == COMMITTED else "-", kept_by,
                      "latest" if r.latest else "")
    console().print(table)


def node_copies(root: CheckpointRoot) -> list[dict[str, Any]]:
    """The copies a local tier keeps under ``root`` (a node directory, or one run's folder in it):
    one row per rank's copy of a step, the run and step its folders name; a copy still arriving
    from another node (or left by a crash, until the next start) is ``arriving``, one dropped
    before its replication ``dropped`` (being deleted)."""
    if not isinstance(root.storage, LocalStorage):
        return []
    rows = []
    for run, step, folder in step_folders(root.location):
        for info in CheckpointRoot(storage_for(str(folder))).scan(include_self=False):
            passing = next((status for prefix, status in ((INCOMING, "arriving"), (DROPPED, "dropped"))
                            if info.name.startswith(prefix)), None)  # whatever it holds: not a copy of the step
            rows.append({"run": run, "step": step, "copy": info.name, "status": passing or info.status,
                         "error": None if passing else info.error,
                         "bytes": info.bytes, "created": info.created, "path": info.location})
    return rows


def show_node_copies(copies: list[dict[str, Any]]) -> None:
    """The table of :func:`node_copies`."""
    table = Table("run", Column("step", justify="right"), "copy", "status", Column("size", justify="right"), "created")
    for c in copies:
        status = c["status"] if c["error"] is None else f"{c['status']}: {c['error']}"
        table.add_row(c["run"], str(c["step"]), c["copy"], status, human_bytes(c["bytes"]), format_time(c["created"]))
    console().print("a node's local tier: each step's copies, one per rank (its own ranks' and the replicas it "
                    "received), each an ordinary checkpoint")
    console().print(table)


@cli.command(epilog=EXIT_STATUSES)
@click.argument("root")
@retention_options
@click.option("--dry-run", "-n", is_flag=True, help="Report what would be deleted; delete nothing.")
@click.option("--force", is_flag=True, help="Prune even while a live writer lease says a manager writes ROOT.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def prune(root: str, keep_last: int | None, keep_every: int | None, keep_best: int | None, metric: str | None,
          mode: str, keep_time_interval: float | None, dry_run: bool, force: bool, as_json: bool) -> None:
    """Delete the committed checkpoints under ROOT that no rule keeps.

    Rules combine: a checkpoint is kept when any rule keeps it. The newest committed checkpoint
    and the one ROOT/latest names are always kept; incomplete, corrupt, unreadable and step-less checkpoint
    directories are left alone. A checkpoint is deleted manifest first, so a half-deleted one is
    never seen as valid. Data files that checkpoints still there refer to (incremental saves) stay
    as retained data, shown by ls, until none refers to them; then prune removes them. Refused while
    a manager holds ROOT's writer lease, unless --force.
    """
    with reported_errors():
        checkpoints = open_root(root)
    where = checkpoints.location
    policy = make_policy(keep_last, keep_every, keep_best, metric, mode, keep_time_interval)
    if policy.keeps_all:
        raise Failure("nothing to prune by: give at least one of --keep-last, --keep-every, --keep-best, "
                      "--keep-time-interval", USAGE)
    with reported_errors():
        if looks_like_checkpoint(checkpoints.storage):
            raise Failure(f"{where} is a checkpoint; prune takes the directory that holds checkpoints", USAGE)
        refuse_live_writer(checkpoints.storage, "pruning", force)
        rows = [r for r in scan(checkpoints, policy, include_root=False) if not r.name.startswith(".")]
        problem = check_metric(rows, policy)
        if problem:
            raise Failure(f"{problem}; refusing to prune by it", USAGE)
        plan = PrunePlan.of(checkpoints, rows)
        leftovers = [] if dry_run else delete(checkpoints, plan.doomed)

    if as_json:
        print_json({
            "root": where, "dry_run": dry_run, "bytes_freed": 0 if dry_run else plan.freed,
            "deleted": [] if dry_run else [plan.doomed_row(r) for r in plan.doomed],
            "would_delete": [plan.doomed_row(r) for r in plan.doomed] if dry_run else [],
            "kept": [prune_row(r) for r in plan.keep],
            "skipped": [{**prune_row(r), "status": r.status, "reason": skip_reason(r)} for r in plan.skipped],
            "retained": [{"name": r.name, "path": r.location, "bytes": r.bytes, "retained_bytes": plan.left[r.name],
                          "referred_to_by": plan.referred_by[r.name],
                          "action": "keep" if plan.left[r.name] else "remove"} for r in plan.retained],
            "leftovers": leftovers,
        })
    else:
        print_prune(plan, dry_run=dry_run, leftovers=leftovers)
    if leftovers:
        click.get_current_context().exit(FAILED)


@dataclass
class PrunePlan:
    """What prune does: the committed checkpoints it deletes, keeps and leaves alone, and the
    retained data there is; ``left``: the bytes each one deleted or retained keeps because the
    checkpoints that stay refer to them (named in ``referred_by``)."""

    doomed: list[Listing]
    keep: list[Listing]
    skipped: list[Listing]
    retained: list[Listing]
    left: dict[str, int]
    referred_by: dict[str, list[str]]

    @classmethod
    def of(cls, root: CheckpointRoot, rows: list[Listing]) -> PrunePlan:
        """The plan for ``rows`` (a scan of ``root``, with the rules that keep each)."""
        ranked = [r for r in rows if r.status == COMMITTED and r.step is not None]
        newest = max((r.step for r in ranked if r.step is not None), default=None)
        doomed = [r for r in ranked if not r.kept_by and r.step != newest]  # the newest: never, whatever kept() says
        keep = [r for r in ranked if r not in doomed]
        retained_data = [r for r in rows if r.status == RETAINED]
        skipped = [r for r in rows if r not in ranked and r not in retained_data]
        gone = {r.name for r in doomed}
        users = referrers(root, rows, gone)
        stay = [r for r in rows if r.status == COMMITTED and r.name not in gone]
        return cls(doomed, keep, skipped, retained_data,
                   {r.name: still_used(r, users) for r in doomed + retained_data},
                   {r.name: [s.name for s in stay if r.name in s.refs.values()] for r in doomed + retained_data})

    @property
    def freed(self) -> int:
        """The bytes the deletions and the removal of retained data nobody refers to any more free."""
        return sum(r.bytes - self.left[r.name] for r in self.doomed + self.retained)

    def doomed_row(self, r: Listing) -> dict[str, Any]:
        """A deleted checkpoint as ``--json`` shows it: with the bytes it keeps as retained data."""
        return {**prune_row(r), "retained_bytes": self.left[r.name], "referred_to_by": self.referred_by[r.name]}


def delete(root: CheckpointRoot, doomed: list[Listing]) -> list[str]:
    """Delete ``doomed`` through the root (what other checkpoints refer to stays, as retained data),
    then remove the retained data that nothing refers to any more; the locations of those that
    could not be removed (neither gone nor retained data)."""
    partly = [r for r in doomed if not root.delete(r.name)]
    root.collect_retained()
    return [r.location for r in partly
            if root.child(r.name).exists() and describe(root.child(r.name), r.name).status != RETAINED]


def prune_row(r: Listing) -> dict[str, Any]:
    return {"name": r.name, "path": r.location, "step": r.step, "bytes": r.bytes, "metrics": r.metrics,
            "kept_by": r.kept_by, "latest": r.latest}


def skip_reason(r: Listing) -> str:
    if r.status != COMMITTED:
        return r.status if r.error is None else f"{r.status}: {r.error}"
    return "committed without a step"


def print_prune(plan: PrunePlan, *, dry_run: bool, leftovers: list[str]) -> None:
    table = Table("name", Column("step", justify="right"), "action", Column("size", justify="right"), "metrics",
                  "why", "latest")
    verb = "would delete" if dry_run else "deleted"

    def kept_for(r: Listing) -> str:
        users = ", ".join(plan.referred_by[r.name]) or "checkpoints set aside"
        return f"{human_bytes(plan.left[r.name])} kept as retained data, read by {users}"

    rows = [(r, verb, "no rule keeps it" + (f"; {kept_for(r)}" if plan.left[r.name] else "")) for r in plan.doomed]
    rows += [(r, "keep", ", ".join(r.kept_by)) for r in plan.keep]
    rows.sort(key=lambda item: (item[0].step, item[0].name))
    rows += [(r, "keep", kept_for(r)) if plan.left[r.name] else
             (r, "would remove" if dry_run else "removed", "retained data nothing refers to any more")
             for r in plan.retained]
    rows += [(r, "leave alone", skip_reason(r)) for r in plan.skipped]
    for r, action, why in rows:
        table.add_row(r.name, "-" if r.step is None else str(r.step), action, human_bytes(r.bytes),
                      format_metrics(r.metrics) if r.status == COMMITTED else "-", why,
                      "latest" if r.latest else "")
    out = console()
    if rows:
        out.print(table)
    out.print(f"{verb} {len(plan.doomed)} checkpoint(s) ({human_bytes(plan.freed)}), kept {len(plan.keep)}, "
              f"left {len(plan.skipped)} alone")
    for path in leftovers:
        console(stderr=True).print(f"could not remove everything under {path} (its manifest is gone)")
