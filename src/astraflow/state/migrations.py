"""Schema of the run's state store, as append-only migrations written with sqlite-utils.

Each migration is a function that receives a sqlite-utils Database inside an open write
transaction. The `migrations` table records the names of the applied ones; a migration, once
released, is never edited: a schema change is a new function appended to MIGRATIONS.

Over 400 lines because every schema change since the first stays here as it was applied (a state.db
of any earlier version is carried forward by running the ones it lacks, in order).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlite_utils import Database

Migration = Callable[[Database], None]


def m0001_initial(db: Database) -> None:
    """The first schema: runs, policies, versions, members, ledger, trajectories, batches, stages, metrics, events."""
    db.table("runs").create(
        {"id": int, "name": str, "recipe": str, "git_sha": str, "created": float},
        pk="id",
        not_null={"name", "recipe"},
    )
    db.table("policies").create(
        {"name": str, "max_staleness": int, "version": int, "step": int},
        pk="name",
        defaults={"version": 0, "step": 0, "max_staleness": 0},
    )
    db.table("versions").create(
        {
            "policy": str,
            "version": int,
            "step": int,
            "weights_addr": str,
            "sha256": str,
            "nbytes": int,
            "created": float,
        },
        pk=("policy", "version"),
    )
    db.table("members").create(
        {
            "id": str,
            "role": str,
            "status": str,
            "policies": str,
            "region": str,
            "hardware": str,
            "slots": int,
            "loaded": str,
            "pid": int,
            "host": str,
            "last_seen": float,
            "joined": float,
        },
        pk="id",
        defaults={"status": "alive", "policies": "[]", "loaded": "{}", "slots": 0},
    )
    db.table("tasks").create(
        {
            "id": int,
            "prompt_key": str,
            "sample": str,
            "roles": str,
            "group_size": int,
            "status": str,
            "owner": str,
            "epoch": int,
            "lease_expiry": float,
            "attempts": int,
            "error": str,
            "created": float,
            "updated": float,
        },
        pk="id",
        defaults={
            "status": "queued",
            "owner": "",
            "epoch": 0,
            "lease_expiry": 0.0,
            "attempts": 0,
            "error": "",
        },
    )
    db.table("tasks").create_index(["status", "id"])
    db.table("tasks").create_index(["owner", "status"])
    db.table("trajectories").create(
        {
            "id": int,
            "task_id": int,
            "policy": str,
            "prompt_key": str,
            "tokens": bytes,
            "loss_mask": bytes,
            "logprobs": bytes,
            "versions": bytes,
            "reward": float,
            "advantage": float,
            "length": int,
            "min_version": int,
            "arrival": int,
            "status": str,
            "consumed_step": int,
        },
        pk="id",
        defaults={"status": "buffered"},
    )
    db.table("trajectories").create_index(["policy", "status"])
    db.table("trajectories").create_index(["task_id"])
    db.table("batches").create(
        {"policy": str, "step": int, "traj_ids": str, "replay": str, "version": int, "created": float},
        pk=("policy", "step"),
    )
    db.table("stage_state").create(
        {"policy": str, "stage": int, "name": str, "state": str, "updated": float}, pk=("policy", "stage")
    )
    db.table("metrics").create({"id": int, "policy": str, "step": int, "values": str, "time": float}, pk="id")
    db.table("metrics").create_index(["policy", "step"])
    db.table("events").create({"id": int, "time": float, "kind": str, "detail": str}, pk="id")


def m0002_sequence_roles(db: Database) -> None:
    """Trajectories keep their workflow role, group key and the sampling settings they were drawn with;
    a task records the policies whose output it does not feed (read-only for it)."""
    db.table("tasks").add_column("read_only", str, not_null_default="[]")
    db.table("tasks").add_column("leased_at", float, not_null_default=0.0)
    t = db.table("trajectories")
    t.add_column("role", str, not_null_default="")
    t.add_column("group_key", str, not_null_default="")
    t.add_column("temperature", float, not_null_default=1.0)
    t.add_column("top_p", float, not_null_default=1.0)
    t.add_column("top_k", int, not_null_default=0)


def m0003_eval_ledger(db: Database) -> None:
    """Held-out evaluation: one round per (policy, version) and one row per evaluation task with its
    rewards once done; evaluation results never become trajectories."""
    db.table("eval_rounds").create(
        {
            "policy": str,
            "version": int,
            "step": int,
            "status": str,
            "tasks": int,
            "metrics": str,
            "created": float,
            "finished": float,
        },
        pk=("policy", "version"),
        defaults={"status": "open", "metrics": "{}", "finished": 0.0},
    )
    db.table("eval_tasks").create(
        {
            "task_id": int,
            "policy": str,
            "version": int,
            "item": str,
            "rewards": str,
            "min_version": int,
            "done": int,
        },
        pk="task_id",
        defaults={"rewards": "[]", "min_version": -1, "done": 0},
    )
    db.table("eval_tasks").create_index(["policy", "version"])


def m0004_status_index(db: Database) -> None:
    """Trajectories indexed by status first: the controller counts the buffered ones on every task
    request, and with (policy, status) alone that count scanned every trajectory of the run."""
    db.table("trajectories").create_index(["status", "policy", "task_id"])


def m0005_member_accounting(db: Database) -> None:
    """Per-member counts of failed attempts, invalid results and lapsed leases, and its quarantine
    (the reason, '' when none, and until when)."""
    members = db.table("members")
    members.add_column("failures", int, not_null_default=0)
    members.add_column("invalid", int, not_null_default=0)
    members.add_column("expiries", int, not_null_default=0)
    members.add_column("quarantined", str, not_null_default="")
    members.add_column("quarantined_until", float, not_null_default=0.0)


def m0006_member_index(db: Database) -> None:
    """Members indexed by status and role: the controller asks for a healthy peer of a role on every
    task request, and a cluster may have thousands of members."""
    db.table("members").create_index(["status", "role", "quarantined"])


def m0007_archived(db: Database) -> None:
    """Trajectories moved out of state.db by a retention pass: per file, policy and status, how many
    and which ids (state/archive.py); file is '' for dropped ones."""
    db.table("archived").create(
        {
            "file": str,
            "policy": str,
            "status": str,
            "rows": int,
            "first_id": int,
            "last_id": int,
            "created": float,
        }
    )
    db.table("archived").create_index(["policy", "status"])


def m0008_retired_tasks(db: Database) -> None:
    """Done tasks a retention pass deleted, counted per owner (state/tasks.py): the status counts and
    each member's completed tasks still include them."""
    db.table("retired_tasks").create({"owner": str, "done": int}, pk="owner")


PACKED_MIGRATION = "0009_packed_tokens"
"""The migration after which trajectories hold packed arrays (protocol 6) instead of msgpack lists."""


def m0009_packed_tokens(db: Database) -> None:
    """Trajectories' per-token columns become packed little-endian arrays (int32 tokens and versions,
    uint8 loss mask, float32 logprobs: protocol/packed.py) instead of msgpack lists; every stored row
    is converted in this transaction. Archive files written before it hold msgpack lists and are not
    rewritten: a run that has them is refused with the reason (resume it with the astraflow that wrote it)."""
    import msgspec

    from astraflow.protocol import packed
    from astraflow.state.store import StateError

    if (
        "archived" in db.table_names()
        and db.execute("SELECT COUNT(*) FROM archived WHERE file != ''").fetchone()[0]
    ):
        raise StateError(
            "this run's archive/ files hold token lists in the msgpack format of protocol 5 and earlier; this astraflow "
            "(protocol 6) stores packed arrays and does not convert archive files",
            hint="resume or read this run with the astraflow version that wrote it",
        )
    ints = msgspec.msgpack.Decoder(list[int])
    floats = msgspec.msgpack.Decoder(list[float])
    conn = db.conn
    after = 0
    while True:
        rows = conn.execute(
            "SELECT id, tokens, loss_mask, logprobs, versions FROM trajectories WHERE id > ? ORDER BY id LIMIT 1000",
            (after,),
        ).fetchall()
        if not rows:
            break
        conn.executemany(
            "UPDATE trajectories SET tokens = ?, loss_mask = ?, logprobs = ?, versions = ? WHERE id = ?",
            [
                (
                    packed.pack_ints("tokens", ints.decode(tok)),
                    packed.pack_mask(ints.decode(mask)),
                    packed.pack_floats("logprobs", floats.decode(lp)),
                    packed.pack_ints("versions", ints.decode(ver)),
                    i,
                )
                for i, tok, mask, lp, ver in rows
            ],
        )
        after = rows[-1][0]


TOKEN_GROUPS_MIGRATION = "0010_token_groups"
"""The migration after which trajectories' per-token arrays live in token_groups (state/token_groups.py)."""


def m0010_token_groups(db: Database) -> None:
    """Trajectories' per-token arrays move to a table of their own, one row per stored group
    (state/token_groups.py), so that a trajectory row is small; every stored row's arrays become a
    group of one, in this transaction, and the four columns leave the trajectories table (SQLite
    rewrites it); its (policy, status) index goes too. Archive files keep every column as before and
    are not touched."""
    db.table("token_groups").create(
        {
            "first_id": int,
            "rows": int,
            "lengths": bytes,
            "tokens": bytes,
            "loss_mask": bytes,
            "logprobs": bytes,
            "versions": bytes,
        },
        pk="first_id",
    )
    conn = db.conn
    conn.execute(
        "INSERT INTO token_groups (first_id, rows, lengths, tokens, loss_mask, logprobs, versions) "
        "SELECT id, 1, CAST(x'' AS BLOB), tokens, loss_mask, logprobs, versions FROM trajectories"
    )
    # a row's one length, as int32 little-endian bytes (its loss mask has one byte per token)
    conn.create_function("astraflow_int32", 1, lambda n: int(n).to_bytes(4, "little", signed=True))
    conn.execute("UPDATE token_groups SET lengths = astraflow_int32(COALESCE(LENGTH(loss_mask), 0))")
    for column in ("tokens", "loss_mask", "logprobs", "versions"):
        conn.execute(f"ALTER TABLE trajectories DROP COLUMN {column}")
    # (status, policy, task_id) serves every query that names a policy (state/trajectories.py names
    # every status for those that do not filter on one): one index less on every insert and update
    conn.execute("DROP INDEX IF EXISTS idx_trajectories_policy_status")


OPEN_INDEX_MIGRATION = "0011_open_status_index"
"""The migration after which the status index holds only the trajectories not consumed."""


def m0011_open_status_index(db: Database) -> None:
    """The (status, policy, task_id) index keeps only the trajectories that are not consumed (a
    partial index, `WHERE status != 'consumed'`): marking a batch consumed then removes 512 index
    entries instead of moving them to the consumed range, and the consumed rows, which grow with
    the run, no longer cost an index entry each. Queries of the other statuses name the index's
    condition (state/trajectories.py, `OPEN` then); those of the consumed rows read the table. Migration
    0012 replaced it."""
    conn = db.conn
    conn.execute("DROP INDEX IF EXISTS idx_trajectories_status_policy_task_id")
    conn.execute(
        "CREATE INDEX idx_trajectories_open ON trajectories (status, policy, task_id) "
        "WHERE status != 'consumed'"
    )


BUFFER_FLOOR_MIGRATION = "0012_buffer_floor"
"""The migration after which the status index holds only the expired and dropped trajectories and the
buffered ones are read from the buffer's floor."""


def m0012_buffer_floor(db: Database) -> None:
    """Storing a sequence and marking it consumed change no index entry: the status index keeps only
    the trajectories that left the buffer untrained (`WHERE status IN ('expired', 'dropped')`, few),
    and the buffered ones, which every stored and every consumed sequence moved in and out of the
    index before, are read by id from the buffer's floor (`buffer_floor`: one row, an id that no
    buffered trajectory is below; state/trajectories.py `BUFFERED`). The floor starts at the oldest
    buffered trajectory, or past the newest row when none is buffered."""
    conn = db.conn
    conn.execute("DROP INDEX IF EXISTS idx_trajectories_open")
    conn.execute(
        "CREATE INDEX idx_trajectories_left ON trajectories (status, policy, task_id) "
        "WHERE status IN ('expired', 'dropped')"
    )
    conn.execute(
        "CREATE TABLE buffer_floor (id INTEGER PRIMARY KEY CHECK (id = 0), first_id INTEGER NOT NULL)"
    )
    conn.execute(
        "INSERT INTO buffer_floor (id, first_id) SELECT 0, COALESCE("
        "(SELECT MIN(id) FROM trajectories WHERE status = 'buffered'), "
        "(SELECT MAX(id) + 1 FROM trajectories), 0)"
    )


MIGRATIONS: list[tuple[str, Migration]] = [
    ("0001_initial", m0001_initial),
    ("0002_sequence_roles", m0002_sequence_roles),
    ("0003_eval_ledger", m0003_eval_ledger),
    ("0004_status_index", m0004_status_index),
    ("0005_member_accounting", m0005_member_accounting),
    ("0006_member_index", m0006_member_index),
    ("0007_archived", m0007_archived),
    ("0008_retired_tasks", m0008_retired_tasks),
    (PACKED_MIGRATION, m0009_packed_tokens),
    (TOKEN_GROUPS_MIGRATION, m0010_token_groups),
    (OPEN_INDEX_MIGRATION, m0011_open_status_index),
    (BUFFER_FLOOR_MIGRATION, m0012_buffer_floor),
]
"""Every migration in the order applied; append only."""


def applied(db: Database) -> list[str]:
    """Names of the migrations already applied to this database, in order."""
    if "migrations" not in db.table_names():
        return []
    return [r["name"] for r in db.query("SELECT name FROM migrations ORDER BY id")]


def apply(db: Database, migrations: list[tuple[str, Migration]] | None = None) -> list[str]:
    """Apply pending migrations, each in its own BEGIN IMMEDIATE transaction; returns the names applied."""
    todo = MIGRATIONS if migrations is None else migrations
    done_now: list[str] = []
    if "migrations" not in db.table_names():
        db.conn.execute("BEGIN IMMEDIATE")
        try:
            db.table("migrations").create(
                {"id": int, "name": str, "applied": float}, pk="id", if_not_exists=True
            )
            db.conn.execute("COMMIT")
        except BaseException:
            db.conn.execute("ROLLBACK")
            raise
    have = set(applied(db))
    for name, fn in todo:
        if name in have:
            continue
        db.conn.execute("BEGIN IMMEDIATE")
        try:
            # Another opener may have applied it between our read and the lock.
            if name not in set(applied(db)):
                fn(db)
                db.table("migrations").insert({"name": name, "applied": time.time()})
                done_now.append(name)
            db.conn.execute("COMMIT")
        except BaseException:
            db.conn.execute("ROLLBACK")
            raise
    return done_now
