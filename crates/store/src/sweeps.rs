//! Sweeps: one command run over many cells, each cell a row that runners in
//! the control plane claim, hold under a lease, and finish.
//!
//! # Life of a cell
//!
//! [`Store::create_sweep`] inserts every cell `pending`. [`Store::claim_cells`]
//! makes up to `max` of them `running` under a fresh random `claim_id`, with
//! `attempts + 1`, `claim_epoch + 1` and a lease; the runner renews the lease
//! ([`Store::renew_lease`]) while the sandbox runs and records the outcome
//! with [`Store::finish_cell`]. Every write about an attempt names its
//! `claim_id` and applies only while the cell is still `running` under it
//! (fencing), so a runner that lost its claim changes nothing.
//! [`Store::expire_leases`] takes back the cells of runners that stopped
//! renewing (crashed, partitioned). The outcome rules:
//!
//! | the attempt ended | the sweep is | the cell becomes |
//! |---|---|---|
//! | succeeded | any | `succeeded` |
//! | failed / timeout | active, `attempts < max_attempts` | `pending` (a retry) |
//! | failed / timeout | active, attempts used up | `failed` / `timeout` |
//! | failed / timeout / cancelled | cancelled | `cancelled` |
//! | cancelled | active | `cancelled` |
//! | lease expired | active, `attempts < max_attempts` | `pending` |
//! | lease expired | active, attempts used up | `failed` (error "lease expired") |
//! | lease expired | cancelled | `cancelled` |
//!
//! `attempts` counts claims, so an attempt lost to a crashed runner counts
//! like a failed one; [`Store::release_cell`] gives a claim back without
//! counting it (a runner shutting down cleanly). When no cell is left
//! `pending` or `running` an active sweep becomes `done`, and any sweep gets
//! its `finished_at`.
//!
//! # Concurrency
//!
//! Several control planes may claim from one database. On PostgreSQL a claim
//! locks the sweep's row `FOR NO KEY UPDATE` (claims of one sweep run one at
//! a time, so the running count read under the lock bounds the throttle) and
//! takes the pending cells `FOR UPDATE SKIP LOCKED`. Finishing, releasing and
//! expiring read the sweep's state under `FOR KEY SHARE`, which does not wait
//! for claims or for one another; cancelling, requeueing and the final
//! `done` take the row `FOR UPDATE`, which waits for all of them, so a retry
//! can never slip back to `pending` in a sweep just cancelled. On SQLite
//! every write goes through the one writer connection, and the
//! multi-statement ones run in `BEGIN IMMEDIATE`.
//!
//! Claiming from every sweep (`sweep_id` None) visits the active sweeps
//! oldest first and skips, on PostgreSQL, those another claimer holds at that
//! moment; only when it claimed nothing does it wait for one of them.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::row::{signed, unsigned, Column};
use crate::sandboxes::already_exists;
use crate::{
    on_reader, on_writer, Backend, CellEnd, CellFilter, CellOutcome, CellRow, CellState, Claim,
    Flavoured, HeldResolution, Metadata, NewSweep, Renewal, Result, Store, StoreError, SweepCounts,
    SweepRow, SweepState, SweepSummary,
};

/// Cells per `INSERT` statement of [`Store::create_sweep`] (two parameters
/// each). Measured with 10,000 cells: SQLite takes ~45 ms at 250-500 but
/// ~130 ms at 2000 and ~400 ms at 8000 (bigger statements cost more than
/// they save); PostgreSQL ~120 ms at 500, ~175 ms at 250 or 2000.
const CELL_BATCH: usize = 500;

/// The columns [`sweep`] reads, as a literal for `concat!`.
macro_rules! sweep_columns {
    () => {
        sweep_columns!("env")
    };
    ($env:literal) => {
        concat!(
            "id, account_id, name, template, command, ",
            $env,
            ", cells, throttle, timeout_seconds, \
             max_attempts, collect, fork_from, state, created_at, finished_at, job_id, reason, \
             after_ok, workdir, files, slurm, started_at, data_path, user_hold, begin_at, \
             prelude_seconds"
        )
    };
}

/// `SELECT` of a sweep row and then `$rest`; on PostgreSQL its env comes
/// through `shoal_sweep_env`, which shows a host's role only the envs of
/// sweeps it has run a cell of.
macro_rules! select_sweep {
    ($rest:literal) => {
        crate::Flavoured {
            sqlite: concat!("SELECT ", sweep_columns!(), $rest),
            postgres: concat!(
                "SELECT ",
                sweep_columns!("shoal_sweep_env(id) AS env"),
                $rest
            ),
        }
    };
}

/// The columns [`cell`] reads, as a literal for `concat!`.
macro_rules! cell_columns {
    () => {
        "sweep_id, idx, value, state, attempts, claim_id, claim_epoch, lease_expires_at, \
         claimed_by, started_at, finished_at, exit_code, elapsed_ms, stdout_tail, stderr_tail, \
         collected, sandbox_id, cpu_seconds, gib_seconds, cost_usd, error, signal, \
         output_truncated, timings, cancel_requested, max_rss_kib, task_cpu_ms"
    };
}

const INSERT_SWEEP: &str = concat!(
    "INSERT INTO sweeps (",
    sweep_columns!(),
    ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, \
     $18, $19, $20, $21, $22, $23, $24, $25, $26)"
);

/// Takes a block of $1 job ids; the block ends before the value returned.
const TAKE_JOB_IDS: &str = "UPDATE counters SET next_value = next_value + $1 \
     WHERE name = 'job_id' RETURNING next_value";

const INSERT_DEP: &str = "INSERT INTO sweep_deps (sweep_id, after_id) VALUES ($1, $2)";

const BY_JOB_ID: Flavoured = select_sweep!(" FROM sweeps WHERE job_id = $1 AND account_id = $2");

/// Notes when a sweep's first cell was claimed.
const SET_STARTED: &str = "UPDATE sweeps SET started_at = $2 WHERE id = $1 AND started_at IS NULL";

/// Whether a dependency `p` finished well: done, every cell succeeded.
macro_rules! finished_well {
    () => {
        "(p.state = 'done' AND NOT EXISTS \
         (SELECT 1 FROM sweep_cells c WHERE c.sweep_id = p.id AND c.state <> 'succeeded'))"
    };
}

/// Held sweeps a dependency of which can no longer finish well.
const HELD_DOOMED: &str = concat!(
    "SELECT s.id FROM sweeps s WHERE s.state = 'held' AND EXISTS (SELECT 1 FROM sweep_deps d \
     JOIN sweeps p ON p.id = d.after_id WHERE d.sweep_id = s.id \
     AND (p.state = 'cancelled' OR (p.state = 'done' AND NOT ",
    finished_well!(),
    "))) ORDER BY s.created_at, s.id"
);

/// Held sweeps not held by their user nor waiting for their begin time
/// ($1: now), every dependency of which finished well.
const HELD_READY: &str = concat!(
    "SELECT s.id FROM sweeps s WHERE s.state = 'held' AND s.user_hold = FALSE \
     AND (s.begin_at IS NULL OR s.begin_at <= $1) \
     AND NOT EXISTS (SELECT 1 FROM sweep_deps d \
     JOIN sweeps p ON p.id = d.after_id WHERE d.sweep_id = s.id AND NOT ",
    finished_well!(),
    ") ORDER BY s.created_at, s.id"
);

const ACTIVATE_HELD: &str =
    "UPDATE sweeps SET state = 'active', reason = NULL WHERE id = $1 AND state = 'held'";
const CANCEL_HELD: &str = "UPDATE sweeps SET state = 'cancelled', \
     reason = 'DependencyNeverSatisfied' WHERE id = $1 AND state = 'held'";

/// A runner's claims, for giving them back when it restarts.
const RUNNER_CLAIMS: &str = "SELECT sweep_id, idx, claim_id FROM sweep_cells \
     WHERE state = 'running' AND claimed_by = $1 ORDER BY sweep_id, idx";
const RUNNER_SANDBOXES: &str = "SELECT sandbox_id FROM sweep_cells \
     WHERE state = 'running' AND claimed_by = $1 AND sandbox_id IS NOT NULL ORDER BY sandbox_id";

const CANCEL_PENDING_CELL: &str = "UPDATE sweep_cells SET state = 'cancelled', finished_at = $3 \
     WHERE sweep_id = $1 AND idx = $2 AND state = 'pending'";
const CANCEL_RUNNING_CELL: &str = "UPDATE sweep_cells SET cancel_requested = TRUE \
     WHERE sweep_id = $1 AND idx = $2 AND state = 'running' \
     RETURNING idx, value, attempts, claim_id, claim_epoch, lease_expires_at";

const GET_CELL: &str = concat!(
    "SELECT ",
    cell_columns!(),
    " FROM sweep_cells WHERE sweep_id = $1 AND idx = $2 \
     AND EXISTS (SELECT 1 FROM sweeps WHERE id = $1 AND account_id = $3)"
);

const SUMMARY: &str = "SELECT state, COUNT(*) AS n, SUM(cpu_seconds) AS cpu, \
     SUM(gib_seconds) AS gib, SUM(cost_usd) AS cost FROM sweep_cells WHERE sweep_id = $1 \
     AND EXISTS (SELECT 1 FROM sweeps WHERE id = $1 AND account_id = $2) GROUP BY state";

const GET: Flavoured = select_sweep!(" FROM sweeps WHERE id = $1 AND account_id = $2");

const BY_ID: Flavoured = select_sweep!(" FROM sweeps WHERE id = $1");

const LIST: Flavoured =
    select_sweep!(" FROM sweeps WHERE account_id = $1 ORDER BY created_at DESC, id");

/// Active sweeps that look claimable (read without locks; the claim checks
/// again under the lock), oldest first.
const CANDIDATES: &str = "SELECT id FROM sweeps s WHERE state = 'active' \
     AND throttle > (SELECT COUNT(*) FROM sweep_cells c WHERE c.sweep_id = s.id AND c.state = 'running') \
     AND EXISTS (SELECT 1 FROM sweep_cells c WHERE c.sweep_id = s.id AND c.state = 'pending') \
     ORDER BY created_at, id";

/// Locks an active sweep for claiming, waiting / skipping it if another
/// claimer holds it. (SQLite needs no lock: `BEGIN IMMEDIATE` serialises.)
const LOCK_CLAIM_POSTGRES: &str =
    "SELECT id FROM sweeps WHERE id = $1 AND state = 'active' FOR NO KEY UPDATE";
const TRY_LOCK_CLAIM_POSTGRES: &str =
    "SELECT id FROM sweeps WHERE id = $1 AND state = 'active' FOR NO KEY UPDATE SKIP LOCKED";

/// Claims the lowest pending cells of sweep $1 if it is active, as many as
/// the throttle leaves room for and at most $6. Runs after the sweep is
/// locked, so the running count it reads cannot grow before it commits.
/// The picked cells are a materialised CTE joined on the primary key: as an
/// `IN (SELECT ... LIMIT)` subquery PostgreSQL may rescan the pick once per
/// outer row, each rescan skipping the rows this statement already updated,
/// and so update past the limit.
macro_rules! claim_sql {
    ($lock:literal) => {
        concat!(
            "WITH picked AS MATERIALIZED (\
             SELECT idx FROM sweep_cells WHERE sweep_id = $1 AND state = 'pending' ORDER BY idx \
             LIMIT (SELECT COALESCE(MAX(CASE WHEN s.throttle <= r.n THEN 0 \
             WHEN s.throttle - r.n < $6 THEN s.throttle - r.n ELSE $6 END), 0) \
             FROM sweeps s, (SELECT COUNT(*) AS n FROM sweep_cells \
             WHERE sweep_id = $1 AND state = 'running') r WHERE s.id = $1 AND s.state = 'active')",
            $lock,
            ") UPDATE sweep_cells SET state = 'running', attempts = attempts + 1, \
             claim_id = $2 || '.' || CAST(sweep_cells.idx AS TEXT), claim_epoch = claim_epoch + 1, \
             lease_expires_at = $3, claimed_by = $4, started_at = $5 \
             FROM picked WHERE sweep_cells.sweep_id = $1 AND sweep_cells.idx = picked.idx \
             RETURNING sweep_cells.idx, value, attempts, claim_id, claim_epoch"
        )
    };
}
const CLAIM_SQLITE: &str = claim_sql!("");
const CLAIM_POSTGRES: &str = claim_sql!(" FOR UPDATE SKIP LOCKED");

const RENEW: &str = "UPDATE sweep_cells SET lease_expires_at = $4 \
     WHERE sweep_id = $1 AND idx = $2 AND claim_id = $3 AND state = 'running' \
     RETURNING (SELECT state FROM sweeps WHERE id = $1) AS sweep_state, cancel_requested";

/// Notes a running attempt's sandbox, fenced by the claim.
const SET_SANDBOX: &str = "UPDATE sweep_cells SET sandbox_id = $4 \
     WHERE sweep_id = $1 AND idx = $2 AND claim_id = $3 AND state = 'running'";

/// The state a finished attempt leaves the cell in ($4: the attempt's end),
/// with `s` the sweep's state and attempt limit. See the module's table.
macro_rules! finish_state {
    () => {
        "(CASE WHEN (s.sweep_state = 'cancelled' OR sweep_cells.cancel_requested) \
         AND $4 <> 'succeeded' THEN 'cancelled' \
         WHEN s.sweep_state IN ('active', 'held') AND $4 IN ('failed', 'timeout') \
         AND sweep_cells.attempts < s.max_attempts THEN 'pending' ELSE $4 END)"
    };
}

/// Records an attempt's outcome, fenced by the claim.
macro_rules! finish_sql {
    ($lock:literal) => {
        concat!(
            "WITH s AS MATERIALIZED (SELECT state AS sweep_state, max_attempts FROM sweeps WHERE id = $1",
            $lock,
            ") UPDATE sweep_cells SET state = ",
            finish_state!(),
            ", finished_at = CASE WHEN ",
            finish_state!(),
            " = 'pending' THEN NULL ELSE $5 END, \
             claim_id = NULL, lease_expires_at = NULL, exit_code = $6, elapsed_ms = $7, \
             stdout_tail = $8, stderr_tail = $9, collected = $10, sandbox_id = $11, \
             cpu_seconds = cpu_seconds + $12, gib_seconds = gib_seconds + $13, \
             cost_usd = cost_usd + $14, error = $15, signal = $16, output_truncated = $17, \
             timings = $18, max_rss_kib = $19, task_cpu_ms = $20 \
             FROM s WHERE sweep_cells.sweep_id = $1 AND sweep_cells.idx = $2 \
             AND sweep_cells.claim_id = $3 AND sweep_cells.state = 'running' \
             RETURNING sweep_cells.state"
        )
    };
}
const FINISH_SQLITE: &str = finish_sql!("");
const FINISH_POSTGRES: &str = finish_sql!(" FOR KEY SHARE");

/// Gives a claim back uncounted (cancelled if the sweep was).
macro_rules! release_sql {
    ($lock:literal) => {
        concat!(
            "WITH s AS MATERIALIZED (SELECT state AS sweep_state FROM sweeps WHERE id = $1",
            $lock,
            ") UPDATE sweep_cells SET \
             state = CASE WHEN s.sweep_state = 'cancelled' OR sweep_cells.cancel_requested \
             THEN 'cancelled' ELSE 'pending' END, \
             finished_at = CASE WHEN s.sweep_state = 'cancelled' OR sweep_cells.cancel_requested \
             THEN $4 ELSE NULL END, \
             attempts = CASE WHEN sweep_cells.attempts > 0 THEN sweep_cells.attempts - 1 ELSE 0 END, \
             claim_id = NULL, lease_expires_at = NULL \
             FROM s WHERE sweep_cells.sweep_id = $1 AND sweep_cells.idx = $2 \
             AND sweep_cells.claim_id = $3 AND sweep_cells.state = 'running' \
             RETURNING sweep_cells.state"
        )
    };
}
const RELEASE_SQLITE: &str = release_sql!("");
const RELEASE_POSTGRES: &str = release_sql!(" FOR KEY SHARE");

/// The state a cell whose lease expired goes to. See the module's table.
macro_rules! expire_state {
    () => {
        "(CASE WHEN s.sweep_state = 'cancelled' OR sweep_cells.cancel_requested THEN 'cancelled' \
         WHEN sweep_cells.attempts < s.max_attempts THEN 'pending' ELSE 'failed' END)"
    };
}

macro_rules! expire_sql {
    ($lock:literal) => {
        concat!(
            "WITH s AS MATERIALIZED (SELECT id, state AS sweep_state, max_attempts FROM sweeps WHERE id IN \
             (SELECT sweep_id FROM sweep_cells WHERE state = 'running' AND lease_expires_at < $1)",
            $lock,
            ") UPDATE sweep_cells SET state = ",
            expire_state!(),
            ", finished_at = CASE WHEN ",
            expire_state!(),
            " = 'pending' THEN NULL ELSE $1 END, \
             claim_id = NULL, lease_expires_at = NULL, exit_code = NULL, elapsed_ms = NULL, \
             stdout_tail = NULL, stderr_tail = NULL, collected = NULL, sandbox_id = NULL, \
             error = 'lease expired' \
             FROM s WHERE sweep_cells.sweep_id = s.id AND sweep_cells.state = 'running' \
             AND sweep_cells.lease_expires_at < $1 \
             RETURNING sweep_cells.sweep_id, sweep_cells.state"
        )
    };
}
const EXPIRE_SQLITE: &str = expire_sql!("");
const EXPIRE_POSTGRES: &str = expire_sql!(" FOR KEY SHARE");

/// Whether any cell of the sweep is still pending or running (one probe of
/// each partial index).
const BUSY: &str =
    "SELECT (EXISTS (SELECT 1 FROM sweep_cells WHERE sweep_id = $1 AND state = 'pending') \
     OR EXISTS (SELECT 1 FROM sweep_cells WHERE sweep_id = $1 AND state = 'running')) AS busy";

const LOCK_SETTLE_SQLITE: &str = "SELECT id FROM sweeps WHERE id = $1";
const LOCK_SETTLE_POSTGRES: &str = "SELECT id FROM sweeps WHERE id = $1 FOR UPDATE";

/// Marks a sweep whose cells are all terminal finished (`done` if active).
const SETTLE: &str = "UPDATE sweeps SET \
     state = CASE WHEN state IN ('active', 'held') THEN 'done' ELSE state END, finished_at = $2 \
     WHERE id = $1 AND finished_at IS NULL \
     AND NOT EXISTS (SELECT 1 FROM sweep_cells WHERE sweep_id = $1 AND state = 'pending') \
     AND NOT EXISTS (SELECT 1 FROM sweep_cells WHERE sweep_id = $1 AND state = 'running')";

/// Locks a sweep the account owns, for cancel and requeue.
const LOCK_OWNED_SQLITE: &str = "SELECT state FROM sweeps WHERE id = $1 AND account_id = $2";
const LOCK_OWNED_POSTGRES: &str =
    "SELECT state FROM sweeps WHERE id = $1 AND account_id = $2 FOR UPDATE";

const CANCEL_SWEEP: &str =
    "UPDATE sweeps SET state = 'cancelled' WHERE id = $1 AND state IN ('active', 'held')";
const CANCEL_PENDING: &str = "UPDATE sweep_cells SET state = 'cancelled', finished_at = $2 \
     WHERE sweep_id = $1 AND state = 'pending'";
const RUNNING_CLAIMS: &str =
    "SELECT idx, value, attempts, claim_id, claim_epoch, lease_expires_at \
     FROM sweep_cells WHERE sweep_id = $1 AND state = 'running' ORDER BY idx";

const REQUEUE_CELLS: &str = "UPDATE sweep_cells SET state = 'pending', attempts = 0, \
     finished_at = NULL, cancel_requested = FALSE \
     WHERE sweep_id = $1 AND state IN ('failed', 'timeout', 'cancelled')";
/// A held sweep stays held: its dependencies still decide.
const REACTIVATE: &str = "UPDATE sweeps SET \
     state = CASE WHEN state = 'held' THEN 'held' ELSE 'active' END, \
     reason = CASE WHEN state = 'held' THEN reason ELSE NULL END, finished_at = NULL WHERE id = $1";

/// `scontrol hold`: an active or held sweep becomes held by its user (its
/// running cells go on; no new one starts).
const HOLD: &str = "UPDATE sweeps SET user_hold = TRUE, state = 'held', reason = 'JobHeldUser' \
     WHERE id = $1 AND account_id = $2 AND state IN ('active', 'held')";
/// `scontrol release`: the user's hold goes; dependencies and the begin
/// time still decide ([`Store::resolve_held`]).
const RELEASE: &str = "UPDATE sweeps SET user_hold = FALSE, reason = CASE \
     WHEN EXISTS (SELECT 1 FROM sweep_deps d WHERE d.sweep_id = sweeps.id) THEN 'Dependency' \
     ELSE 'BeginTime' END \
     WHERE id = $1 AND account_id = $2 AND state = 'held' AND user_hold = TRUE";

const SET_THROTTLE: &str = "UPDATE sweeps SET throttle = $3 WHERE id = $1 AND account_id = $2";

const COUNTS: &str = "SELECT state, COUNT(*) AS n FROM sweep_cells WHERE sweep_id = $1 \
     AND EXISTS (SELECT 1 FROM sweeps WHERE id = $1 AND account_id = $2) GROUP BY state";

const LIST_CELLS: &str = concat!(
    "SELECT ",
    cell_columns!(),
    " FROM sweep_cells WHERE sweep_id = $1 \
     AND EXISTS (SELECT 1 FROM sweeps WHERE id = $1 AND account_id = $2) \
     AND ($3 IS NULL OR state = $3) AND idx > $4 ORDER BY idx LIMIT $5 OFFSET $6"
);

/// The SQL that differs between the backends.
struct Dialect {
    begin: &'static str,
    /// None where the transaction itself serialises claims.
    lock_claim: Option<&'static str>,
    /// Like `lock_claim`, but yielding nothing at once for a sweep another
    /// claimer holds.
    try_lock_claim: Option<&'static str>,
    claim: &'static str,
    finish: &'static str,
    release: &'static str,
    expire: &'static str,
    lock_settle: &'static str,
    lock_owned: &'static str,
}

const SQLITE: Dialect = Dialect {
    begin: "BEGIN IMMEDIATE",
    lock_claim: None,
    try_lock_claim: None,
    claim: CLAIM_SQLITE,
    finish: FINISH_SQLITE,
    release: RELEASE_SQLITE,
    expire: EXPIRE_SQLITE,
    lock_settle: LOCK_SETTLE_SQLITE,
    lock_owned: LOCK_OWNED_SQLITE,
};

const POSTGRES: Dialect = Dialect {
    begin: "BEGIN",
    lock_claim: Some(LOCK_CLAIM_POSTGRES),
    try_lock_claim: Some(TRY_LOCK_CLAIM_POSTGRES),
    claim: CLAIM_POSTGRES,
    finish: FINISH_POSTGRES,
    release: RELEASE_POSTGRES,
    expire: EXPIRE_POSTGRES,
    lock_settle: LOCK_SETTLE_POSTGRES,
    lock_owned: LOCK_OWNED_POSTGRES,
};

impl Store {
    fn dialect(&self) -> &'static Dialect {
        match &*self.inner {
            Backend::Sqlite { .. } => &SQLITE,
            Backend::Postgres(_) => &POSTGRES,
        }
    }

    /// Inserts the sweep and every cell `pending`, in one transaction (cells
    /// in multi-row inserts of 500), with a block of as many job ids as it
    /// has cells (at least one) taken from the `job_id` counter in the same
    /// transaction. The sweep is `active`, or `held` (reason `Dependency`)
    /// when it has `after_ok`; a sweep of no cells is `done` at once.
    /// [`StoreError::AlreadyExists`] if the id is taken.
    pub async fn create_sweep(&self, new: &NewSweep, now: f64) -> Result<SweepRow> {
        let later = new.begin_at.is_some_and(|at| at > now);
        let held = (!new.after_ok.is_empty() || new.hold || later) && !new.cells.is_empty();
        // Slurm's reason: what holds it first.
        let reason = if new.hold {
            "JobHeldUser"
        } else if !new.after_ok.is_empty() {
            "Dependency"
        } else {
            "BeginTime"
        };
        let mut row = SweepRow {
            id: new.id.clone(),
            account_id: new.account_id,
            name: new.name.clone(),
            template: new.template.clone(),
            command: new.command.clone(),
            env: new.env.clone(),
            cells: new.cells.clone(),
            throttle: new.throttle,
            timeout_seconds: new.timeout_seconds,
            max_attempts: new.max_attempts,
            collect: new.collect.clone(),
            fork_from: new.fork_from.clone(),
            state: if new.cells.is_empty() {
                SweepState::Done
            } else if held {
                SweepState::Held
            } else {
                SweepState::Active
            },
            created_at: now,
            finished_at: new.cells.is_empty().then_some(now),
            job_id: 0,
            reason: held.then(|| reason.to_owned()),
            after_ok: new.after_ok.clone(),
            workdir: new.workdir.clone(),
            files: new.files.clone(),
            slurm: new.slurm.clone(),
            started_at: None,
            data_path: new.data_path.clone(),
            user_hold: new.hold,
            begin_at: new.begin_at,
            prelude_seconds: None,
        };
        let block = signed(new.cells.len().max(1) as u64);
        let after_ok = to_json(&new.after_ok);
        let files = to_json(&new.files);
        let slurm = new.slurm.as_ref().map(to_json);
        let data_path = new.data_path.as_ref().map(to_json);
        let env = to_json(&new.env);
        let cells = to_json(&new.cells);
        let collect = to_json(&new.collect);
        let fork_from = new.fork_from.as_ref().map(to_json);
        let full_batch = insert_cells_sql(CELL_BATCH);
        let begin = self.dialect().begin;
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            let next = sqlx::query(TAKE_JOB_IDS)
                .bind(block)
                .fetch_one(&mut *tx)
                .await?
                .int("next_value")?;
            row.job_id = unsigned(next - block, "job_id")?;
            sqlx::query(INSERT_SWEEP)
                .bind(&row.id)
                .bind(row.account_id)
                .bind(&row.name)
                .bind(&row.template)
                .bind(&row.command)
                .bind(&env)
                .bind(&cells)
                .bind(i64::from(row.throttle))
                .bind(signed(row.timeout_seconds))
                .bind(i64::from(row.max_attempts))
                .bind(&collect)
                .bind(&fork_from)
                .bind(row.state.as_str())
                .bind(row.created_at)
                .bind(row.finished_at)
                .bind(signed(row.job_id))
                .bind(&row.reason)
                .bind(&after_ok)
                .bind(&row.workdir)
                .bind(&files)
                .bind(&slurm)
                .bind(row.started_at)
                .bind(&data_path)
                .bind(row.user_hold)
                .bind(row.begin_at)
                .bind(row.prelude_seconds)
                .execute(&mut *tx)
                .await
                .map_err(|e| already_exists(e, "sweep", &row.id))?;
            for after in &new.after_ok {
                sqlx::query(INSERT_DEP).bind(&row.id).bind(after).execute(&mut *tx).await?;
            }
            for (batch, chunk) in new.cells.chunks(CELL_BATCH).enumerate() {
                let partial;
                let sql = if chunk.len() == CELL_BATCH {
                    &full_batch
                } else {
                    partial = insert_cells_sql(chunk.len());
                    &partial
                };
                let mut query = sqlx::query(sql).bind(&row.id);
                for (i, value) in chunk.iter().enumerate() {
                    query = query.bind(signed((batch * CELL_BATCH + i) as u64)).bind(value);
                }
                query.execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        Ok(row)
    }

    /// The sweep, in any state, if `account_id` owns it.
    pub async fn get_sweep(&self, account_id: i64, id: &str) -> Result<Option<SweepRow>> {
        on_reader!(self, pool => {
            sqlx::query(GET.on(pool))
                .bind(id)
                .bind(account_id)
                .fetch_optional(pool)
                .await?
                .map(|r| sweep(&r))
                .transpose()
        })
    }

    /// The sweep whoever owns it. For the control plane's own work (the
    /// runner reading what to run for a claim), never for a tenant's request.
    pub async fn sweep_by_id(&self, id: &str) -> Result<Option<SweepRow>> {
        on_reader!(self, pool => {
            sqlx::query(BY_ID.on(pool))
                .bind(id)
                .fetch_optional(pool)
                .await?
                .map(|r| sweep(&r))
                .transpose()
        })
    }

    /// The account's sweeps in every state, newest first.
    pub async fn list_sweeps(&self, account_id: i64) -> Result<Vec<SweepRow>> {
        on_reader!(self, pool => {
            sqlx::query(LIST.on(pool)).bind(account_id).fetch_all(pool).await?.iter().map(sweep).collect()
        })
    }

    /// Cells of the sweep per state; all zero if `account_id` does not own it.
    pub async fn sweep_counts(&self, account_id: i64, id: &str) -> Result<SweepCounts> {
        let rows: Vec<(String, i64)> = on_reader!(self, pool => {
            sqlx::query(COUNTS)
                .bind(id)
                .bind(account_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok((r.text("state")?, r.int("n")?)))
                .collect::<Result<_>>()?
        });
        let mut counts = SweepCounts::default();
        for (state, n) in rows {
            *counts.get_mut(state.parse()?) += unsigned::<u64>(n, "count")?;
        }
        Ok(counts)
    }

    /// How many cells of every sweep of every account are in each state
    /// (the operator's metrics).
    pub async fn cell_counts_by_state(&self) -> Result<Vec<(String, u64)>> {
        let rows: Vec<(String, i64)> = on_reader!(self, pool => {
            sqlx::query("SELECT state, COUNT(*) AS n FROM sweep_cells GROUP BY state")
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok((r.text("state")?, r.int("n")?)))
                .collect::<Result<_>>()?
        });
        rows.into_iter()
            .map(|(state, n)| Ok((state, unsigned::<u64>(n, "count")?)))
            .collect()
    }

    /// The sweep's cells that pass `filter`, in index order; none if
    /// `account_id` does not own it.
    pub async fn list_cells(
        &self,
        account_id: i64,
        id: &str,
        filter: &CellFilter,
    ) -> Result<Vec<CellRow>> {
        let state = filter.state.map(CellState::as_str);
        let after = filter.after.map_or(-1, i64::from);
        let limit = filter.limit.map_or(i64::MAX, i64::from);
        on_reader!(self, pool => {
            sqlx::query(LIST_CELLS)
                .bind(id)
                .bind(account_id)
                .bind(state)
                .bind(after)
                .bind(limit)
                .bind(filter.offset.map_or(0, i64::from))
                .fetch_all(pool)
                .await?
                .iter()
                .map(cell)
                .collect()
        })
    }

    /// Claims for `runner` up to `max` pending cells (lowest index first) of
    /// the sweep `sweep_id`, or of every active sweep (oldest first) when
    /// None, never letting a sweep's running cells exceed its throttle. Each
    /// claimed cell becomes `running` with `attempts + 1`, `claim_epoch + 1`,
    /// a fresh random claim id and a lease until `now + lease`. Concurrent
    /// claimers, in this process or others, never take the same cell.
    /// Cancelled and done sweeps yield nothing.
    pub async fn claim_cells(
        &self,
        runner: &str,
        sweep_id: Option<&str>,
        max: u32,
        lease: Duration,
        now: f64,
    ) -> Result<Vec<Claim>> {
        let max = max as usize;
        if max == 0 {
            return Ok(Vec::new());
        }
        let dialect = self.dialect();
        let token = random_token();
        let expires = now + lease.as_secs_f64();
        let mut claims = Vec::new();
        on_writer!(self, pool => {
            // Claims one locked sweep's cells into `claims`.
            macro_rules! claim_from {
                ($tx:expr, $id:expr) => {{
                    let rows = sqlx::query(dialect.claim)
                        .bind($id)
                        .bind(&token)
                        .bind(expires)
                        .bind(runner)
                        .bind(now)
                        .bind(signed((max - claims.len()) as u64))
                        .fetch_all(&mut *$tx)
                        .await?;
                    let mut got = rows
                        .iter()
                        .map(|r| claim($id, r, expires))
                        .collect::<Result<Vec<_>>>()?;
                    got.sort_by_key(|c| c.idx);
                    if !got.is_empty() {
                        sqlx::query(SET_STARTED).bind($id).bind(now).execute(&mut *$tx).await?;
                    }
                    claims.extend(got);
                }};
            }
            let mut tx = pool.begin_with(dialect.begin).await?;
            let candidates: Vec<String> = match sweep_id {
                Some(id) => vec![id.to_owned()],
                None => sqlx::query(CANDIDATES)
                    .fetch_all(&mut *tx)
                    .await?
                    .iter()
                    .map(|r| r.text("id"))
                    .collect::<sqlx::Result<_>>()?,
            };
            let try_lock = dialect.try_lock_claim.filter(|_| sweep_id.is_none());
            let mut skipped = None;
            for id in &candidates {
                if claims.len() >= max {
                    break;
                }
                if let Some(lock) = try_lock.or(dialect.lock_claim) {
                    let locked = sqlx::query(lock).bind(id).fetch_optional(&mut *tx).await?;
                    if locked.is_none() {
                        skipped.get_or_insert(id);
                        continue;
                    }
                }
                claim_from!(tx, id.as_str());
            }
            tx.commit().await?;
            // Everything this claimer could lock had no room, and another
            // claimer held a sweep: wait for that one rather than report no
            // work (in a fresh transaction, holding no other lock).
            if let (true, Some(_), Some(lock), Some(id)) =
                (claims.is_empty(), try_lock, dialect.lock_claim, skipped)
            {
                let mut tx = pool.begin_with(dialect.begin).await?;
                let locked = sqlx::query(lock).bind(id).fetch_optional(&mut *tx).await?;
                if locked.is_some() {
                    claim_from!(tx, id.as_str());
                }
                tx.commit().await?;
            }
        });
        Ok(claims)
    }

    /// Extends a claim's lease to `now + lease`, if the claim still holds.
    /// [`Renewal::Lost`] when it does not (the lease expired and was swept
    /// by [`Store::expire_leases`], or the cell was finished): the runner
    /// must stop and record nothing. [`Renewal::Cancelled`] when the sweep
    /// was cancelled meanwhile (how a runner in another control plane learns
    /// of it). A lease past its time but not yet swept still renews.
    pub async fn renew_lease(
        &self,
        sweep_id: &str,
        idx: u32,
        claim_id: &str,
        lease: Duration,
        now: f64,
    ) -> Result<Renewal> {
        let found: Option<(String, bool)> = on_writer!(self, pool => {
            sqlx::query(RENEW)
                .bind(sweep_id)
                .bind(i64::from(idx))
                .bind(claim_id)
                .bind(now + lease.as_secs_f64())
                .fetch_optional(pool)
                .await?
                .map(|r| Ok::<_, sqlx::Error>((r.text("sweep_state")?, r.boolean("cancel_requested")?)))
                .transpose()?
        });
        Ok(match found {
            None => Renewal::Lost,
            Some((state, cancel_requested)) if state == "cancelled" || cancel_requested => {
                Renewal::Cancelled
            }
            Some(_) => Renewal::Renewed,
        })
    }

    /// Records the sandbox an attempt under `claim_id` runs in, while that
    /// claim holds (so a running cell shows where it runs: squeue's
    /// NODELIST). False if the claim was lost; nothing changed then.
    pub async fn set_cell_sandbox(
        &self,
        sweep_id: &str,
        idx: u32,
        claim_id: &str,
        sandbox_id: &str,
    ) -> Result<bool> {
        let done = on_writer!(self, pool => {
            sqlx::query(SET_SANDBOX)
                .bind(sweep_id)
                .bind(i64::from(idx))
                .bind(claim_id)
                .bind(sandbox_id)
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(done > 0)
    }

    /// Records the outcome of the attempt under `claim_id`, if that claim
    /// still holds (the cell is `running` under it): the state it leaves the
    /// cell in (the module's table: a failure or timeout with attempts left
    /// is a retry, `pending`). None if the claim was lost, in which case
    /// nothing changed. The outcome fields are overwritten, the usage fields
    /// added to, the cost priced with the store's rate card. When this was
    /// the last unfinished cell, the sweep is finished at
    /// `outcome.finished_at`.
    pub async fn finish_cell(
        &self,
        sweep_id: &str,
        idx: u32,
        claim_id: &str,
        outcome: &CellOutcome,
    ) -> Result<Option<CellState>> {
        let sql = self.dialect().finish;
        let collected = outcome.collected.as_ref().map(to_json);
        let timings = outcome.timings.as_ref().map(to_json);
        let cost = self
            .rate_card
            .cost(outcome.cpu_seconds, outcome.gib_seconds);
        let state: Option<String> = on_writer!(self, pool => {
            sqlx::query(sql)
                .bind(sweep_id)
                .bind(i64::from(idx))
                .bind(claim_id)
                .bind(outcome.end.state().as_str())
                .bind(outcome.finished_at)
                .bind(outcome.exit_code.map(i64::from))
                .bind(outcome.elapsed_ms.map(signed))
                .bind(&outcome.stdout_tail)
                .bind(&outcome.stderr_tail)
                .bind(&collected)
                .bind(&outcome.sandbox_id)
                .bind(outcome.cpu_seconds)
                .bind(outcome.gib_seconds)
                .bind(cost)
                .bind(&outcome.error)
                .bind(outcome.signal.map(i64::from))
                .bind(outcome.output_truncated)
                .bind(&timings)
                .bind(outcome.max_rss_kib.map(signed))
                .bind(outcome.task_cpu_ms.map(signed))
                .fetch_optional(pool)
                .await?
                .map(|r| r.text("state"))
                .transpose()?
        });
        let Some(state) = state else {
            return Ok(None);
        };
        let state: CellState = state.parse()?;
        if state.is_terminal() {
            self.settle(sweep_id, outcome.finished_at).await?;
        }
        Ok(Some(state))
    }

    /// Gives a claim back without counting the attempt (`attempts - 1`): the
    /// cell is `pending` again, or `cancelled` if the sweep was. For a runner
    /// that stops a cell it will not finish (shutting down); its sandbox must
    /// be gone first. False if the claim was already lost.
    pub async fn release_cell(
        &self,
        sweep_id: &str,
        idx: u32,
        claim_id: &str,
        now: f64,
    ) -> Result<bool> {
        let sql = self.dialect().release;
        let state: Option<String> = on_writer!(self, pool => {
            sqlx::query(sql)
                .bind(sweep_id)
                .bind(i64::from(idx))
                .bind(claim_id)
                .bind(now)
                .fetch_optional(pool)
                .await?
                .map(|r| r.text("state"))
                .transpose()?
        });
        let Some(state) = state else {
            return Ok(false);
        };
        if state.parse::<CellState>()?.is_terminal() {
            self.settle(sweep_id, now).await?;
        }
        Ok(true)
    }

    /// Takes back every running cell whose lease ended before `now`: its
    /// claim is cleared and it goes back to `pending`, or to `failed` (error
    /// "lease expired") when its attempts are used up, or to `cancelled` in
    /// a cancelled sweep. Sweeps left with nothing unfinished are finished.
    /// Returns how many cells it took back. Safe to run from every control
    /// plane at once.
    pub async fn expire_leases(&self, now: f64) -> Result<u64> {
        let sql = self.dialect().expire;
        let rows: Vec<(String, String)> = on_writer!(self, pool => {
            sqlx::query(sql)
                .bind(now)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok((r.text("sweep_id")?, r.text("state")?)))
                .collect::<Result<_>>()?
        });
        let mut to_settle = BTreeSet::new();
        for (sweep_id, state) in &rows {
            if state.parse::<CellState>()?.is_terminal() {
                to_settle.insert(sweep_id);
            }
        }
        for sweep_id in to_settle {
            self.settle(sweep_id, now).await?;
        }
        Ok(rows.len() as u64)
    }

    /// Cancels the sweep if `account_id` owns it (None otherwise): no cell is
    /// claimed any more, pending cells become `cancelled`, and the claims of
    /// the cells still running are returned so that their sandboxes can be
    /// killed (the runners holding them also learn it from
    /// [`Store::renew_lease`]); each records `cancelled` when finished, or
    /// `succeeded` if it did. Cancelling a cancelled sweep returns the claims
    /// still running; a done sweep stays done.
    pub async fn cancel_sweep(
        &self,
        account_id: i64,
        id: &str,
        now: f64,
    ) -> Result<Option<Vec<Claim>>> {
        let dialect = self.dialect();
        let running = on_writer!(self, pool => {
            let mut tx = pool.begin_with(dialect.begin).await?;
            let found = sqlx::query(dialect.lock_owned)
                .bind(id)
                .bind(account_id)
                .fetch_optional(&mut *tx)
                .await?;
            if found.is_none() {
                return Ok(None);
            }
            sqlx::query(CANCEL_SWEEP).bind(id).execute(&mut *tx).await?;
            sqlx::query(CANCEL_PENDING).bind(id).bind(now).execute(&mut *tx).await?;
            let running = sqlx::query(RUNNING_CLAIMS)
                .bind(id)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| {
                    let expires = r.real("lease_expires_at")?;
                    claim(id, r, expires)
                })
                .collect::<Result<Vec<_>>>()?;
            tx.commit().await?;
            running
        });
        self.settle(id, now).await?;
        Ok(Some(running))
    }

    /// Puts the sweep's `failed`, `timeout` and `cancelled` cells back to
    /// `pending` with their attempts reset, and makes the sweep active again
    /// if there were any (also a cancelled one; a held one stays held).
    /// None if `account_id` does not own the sweep, else how many cells.
    pub async fn requeue_failed(&self, account_id: i64, id: &str) -> Result<Option<u64>> {
        let dialect = self.dialect();
        let requeued = on_writer!(self, pool => {
            let mut tx = pool.begin_with(dialect.begin).await?;
            let found = sqlx::query(dialect.lock_owned)
                .bind(id)
                .bind(account_id)
                .fetch_optional(&mut *tx)
                .await?;
            if found.is_none() {
                return Ok(None);
            }
            let requeued = sqlx::query(REQUEUE_CELLS).bind(id).execute(&mut *tx).await?.rows_affected();
            if requeued > 0 {
                sqlx::query(REACTIVATE).bind(id).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            requeued
        });
        Ok(Some(requeued))
    }

    /// Sets how many of the sweep's cells may run at once, from the next
    /// claim on (lowering it stops no running cell; 0 pauses the sweep).
    /// False if `account_id` does not own the sweep.
    pub async fn set_throttle(&self, account_id: i64, id: &str, throttle: u32) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(SET_THROTTLE)
                .bind(id)
                .bind(account_id)
                .bind(i64::from(throttle))
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(affected > 0)
    }

    /// Finishes the sweep at `now` if no cell is pending or running. Called
    /// after a cell became terminal, once that change committed: the writer
    /// of the last such change always sees every other, so some call
    /// finishes the sweep. The cheap probe first; the lock (which waits for
    /// finishes in flight) only when it finds nothing unfinished.
    async fn settle(&self, id: &str, now: f64) -> Result<()> {
        let busy: bool = on_reader!(self, pool => {
            sqlx::query(BUSY).bind(id).fetch_one(pool).await?.boolean("busy")?
        });
        if busy {
            return Ok(());
        }
        let dialect = self.dialect();
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(dialect.begin).await?;
            sqlx::query(dialect.lock_settle).bind(id).fetch_optional(&mut *tx).await?;
            sqlx::query(SETTLE).bind(id).bind(now).execute(&mut *tx).await?;
            tx.commit().await?;
        });
        Ok(())
    }
}

impl Store {
    /// The sweep whose first job id is `job_id`, if `account_id` owns it.
    pub async fn sweep_by_job_id(&self, account_id: i64, job_id: u64) -> Result<Option<SweepRow>> {
        on_reader!(self, pool => {
            sqlx::query(BY_JOB_ID.on(pool))
                .bind(signed(job_id))
                .bind(account_id)
                .fetch_optional(pool)
                .await?
                .map(|r| sweep(&r))
                .transpose()
        })
    }

    /// One cell, if `account_id` owns its sweep.
    pub async fn get_cell(&self, account_id: i64, id: &str, idx: u32) -> Result<Option<CellRow>> {
        on_reader!(self, pool => {
            sqlx::query(GET_CELL)
                .bind(id)
                .bind(i64::from(idx))
                .bind(account_id)
                .fetch_optional(pool)
                .await?
                .map(|r| cell(&r))
                .transpose()
        })
    }

    /// Cells per state and the usage of every attempt, summed; all zero if
    /// `account_id` does not own the sweep.
    pub async fn sweep_summary(&self, account_id: i64, id: &str) -> Result<SweepSummary> {
        let rows: Vec<(String, i64, f64, f64, f64)> = on_reader!(self, pool => {
            sqlx::query(SUMMARY)
                .bind(id)
                .bind(account_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok((r.text("state")?, r.int("n")?, r.real("cpu")?, r.real("gib")?, r.real("cost")?)))
                .collect::<Result<_>>()?
        });
        let mut summary = SweepSummary::default();
        for (state, n, cpu, gib, cost) in rows {
            *summary.counts.get_mut(state.parse()?) += unsigned::<u64>(n, "count")?;
            summary.cpu_seconds += cpu;
            summary.gib_seconds += gib;
            summary.cost_usd += cost;
        }
        Ok(summary)
    }

    /// Decides held sweeps: one a dependency of which was cancelled or is
    /// done with a cell that did not succeed becomes `cancelled` (reason
    /// `DependencyNeverSatisfied`, its cells `cancelled`, finished at
    /// `now`); one whose dependencies are all done with every cell
    /// succeeded becomes `active`. Safe to run from every control plane at
    /// once (each change applies only to a sweep still held).
    pub async fn resolve_held(&self, now: f64) -> Result<HeldResolution> {
        let (doomed, ready): (Vec<String>, Vec<String>) = on_reader!(self, pool => {
            let doomed = sqlx::query(HELD_DOOMED).fetch_all(pool).await?;
            let ready = sqlx::query(HELD_READY).bind(now).fetch_all(pool).await?;
            (
                doomed.iter().map(|r| r.text("id")).collect::<sqlx::Result<Vec<String>>>()?,
                ready.iter().map(|r| r.text("id")).collect::<sqlx::Result<Vec<String>>>()?,
            )
        });
        let mut resolution = HeldResolution::default();
        let begin = self.dialect().begin;
        for id in doomed {
            let changed = on_writer!(self, pool => {
                let mut tx = pool.begin_with(begin).await?;
                let changed = sqlx::query(CANCEL_HELD).bind(&id).execute(&mut *tx).await?.rows_affected();
                if changed > 0 {
                    sqlx::query(CANCEL_PENDING).bind(&id).bind(now).execute(&mut *tx).await?;
                }
                tx.commit().await?;
                changed
            });
            if changed > 0 {
                self.settle(&id, now).await?;
                resolution.cancelled.push(id);
            }
        }
        for id in ready {
            let changed = on_writer!(self, pool => {
                sqlx::query(ACTIVATE_HELD).bind(&id).execute(pool).await?.rows_affected()
            });
            if changed > 0 {
                resolution.activated.push(id);
            }
        }
        Ok(resolution)
    }

    /// Records how long the sweep's `fork_from` setup took.
    pub async fn set_prelude_seconds(&self, sweep_id: &str, seconds: f64) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query("UPDATE sweeps SET prelude_seconds = $2 WHERE id = $1")
                .bind(sweep_id)
                .bind(seconds)
                .execute(pool)
                .await?;
        });
        Ok(())
    }

    /// Holds the account's sweep (`scontrol hold`); false if it is not
    /// active or held (finished, cancelled, or not the account's).
    pub async fn hold_sweep(&self, account_id: i64, id: &str) -> Result<bool> {
        on_writer!(self, pool => {
            Ok(sqlx::query(HOLD).bind(id).bind(account_id).execute(pool).await?.rows_affected() > 0)
        })
    }

    /// Releases the user's hold of the account's sweep (`scontrol
    /// release`) and activates it if nothing else holds it; false if it
    /// was not held by its user.
    pub async fn release_sweep(&self, account_id: i64, id: &str, now: f64) -> Result<bool> {
        let released = on_writer!(self, pool => {
            sqlx::query(RELEASE).bind(id).bind(account_id).execute(pool).await?.rows_affected() > 0
        });
        if released {
            self.resolve_held(now).await?;
        }
        Ok(released)
    }

    /// Cancels the cells `indexes` of the sweep, if `account_id` owns it
    /// (None otherwise): pending ones become `cancelled` at once; running
    /// ones are marked, and their claims returned so that their sandboxes
    /// can be killed (the runner holding one also learns it from
    /// [`Store::renew_lease`]); each records `cancelled` when finished
    /// unless it succeeded. Indexes that do not exist or are finished are
    /// left alone.
    pub async fn cancel_cells(
        &self,
        account_id: i64,
        id: &str,
        indexes: &[u32],
        now: f64,
    ) -> Result<Option<Vec<Claim>>> {
        let dialect = self.dialect();
        let running = on_writer!(self, pool => {
            let mut tx = pool.begin_with(dialect.begin).await?;
            let found = sqlx::query(dialect.lock_owned)
                .bind(id)
                .bind(account_id)
                .fetch_optional(&mut *tx)
                .await?;
            if found.is_none() {
                return Ok(None);
            }
            let mut running = Vec::new();
            for &idx in indexes {
                sqlx::query(CANCEL_PENDING_CELL)
                    .bind(id)
                    .bind(i64::from(idx))
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                if let Some(r) = sqlx::query(CANCEL_RUNNING_CELL)
                    .bind(id)
                    .bind(i64::from(idx))
                    .fetch_optional(&mut *tx)
                    .await?
                {
                    let expires = r.real("lease_expires_at")?;
                    running.push(claim(id, &r, expires)?);
                }
            }
            tx.commit().await?;
            running
        });
        self.settle(id, now).await?;
        Ok(Some(running))
    }

    /// Gives back, uncounted, every claim `runner` holds: for a runner
    /// starting again after a crash, whose sandboxes are gone (see
    /// [`Store::release_cell`]). Returns how many.
    /// The sandboxes of the cells `runner` holds claims on (what its
    /// attempts ran in).
    pub async fn runner_claim_sandboxes(&self, runner: &str) -> Result<Vec<String>> {
        on_reader!(self, pool => {
            sqlx::query(RUNNER_SANDBOXES)
                .bind(runner)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok(r.text("sandbox_id")?))
                .collect()
        })
    }

    pub async fn release_runner_claims(&self, runner: &str, now: f64) -> Result<u64> {
        let claims: Vec<(String, i64, String)> = on_reader!(self, pool => {
            sqlx::query(RUNNER_CLAIMS)
                .bind(runner)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok((r.text("sweep_id")?, r.int("idx")?, r.text("claim_id")?)))
                .collect::<Result<_>>()?
        });
        let mut released = 0;
        for (sweep_id, idx, claim_id) in claims {
            if self
                .release_cell(&sweep_id, unsigned(idx, "idx")?, &claim_id, now)
                .await?
            {
                released += 1;
            }
        }
        Ok(released)
    }
}

/// `INSERT` of `n` cells: `$1` the sweep id, then index and value per cell.
fn insert_cells_sql(n: usize) -> String {
    let mut sql = String::from("INSERT INTO sweep_cells (sweep_id, idx, value) VALUES ");
    for i in 0..n {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str(&format!("($1, ${}, ${})", 2 * i + 2, 2 * i + 3));
    }
    sql
}

/// 128 random bits in hex: the part of a claim id that makes it unguessable
/// and fresh (the cell index follows it).
fn random_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn to_json<T: Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).expect("strings, lists and JSON values always serialise")
}

fn from_json<T: for<'de> Deserialize<'de>>(json: &str, what: &str) -> Result<T> {
    serde_json::from_str(json).map_err(|e| StoreError::Corrupt(format!("{what} {json:?}: {e}")))
}

fn sweep(row: &impl Column) -> Result<SweepRow> {
    Ok(SweepRow {
        id: row.text("id")?,
        account_id: row.int("account_id")?,
        name: row.text("name")?,
        template: row.text("template")?,
        command: row.text("command")?,
        env: from_json::<Metadata>(&row.text("env")?, "sweep env")?,
        cells: from_json(&row.text("cells")?, "sweep cells")?,
        throttle: unsigned(row.int("throttle")?, "throttle")?,
        timeout_seconds: unsigned(row.int("timeout_seconds")?, "timeout_seconds")?,
        max_attempts: unsigned(row.int("max_attempts")?, "max_attempts")?,
        collect: from_json(&row.text("collect")?, "sweep collect")?,
        fork_from: row
            .opt_text("fork_from")?
            .map(|j| from_json(&j, "sweep fork_from"))
            .transpose()?,
        state: row.text("state")?.parse()?,
        created_at: row.real("created_at")?,
        finished_at: row.opt_real("finished_at")?,
        job_id: unsigned(
            row.opt_int("job_id")?
                .ok_or_else(|| StoreError::Corrupt("sweep without a job_id".to_owned()))?,
            "job_id",
        )?,
        reason: row.opt_text("reason")?,
        after_ok: from_json(&row.text("after_ok")?, "sweep after_ok")?,
        workdir: row.opt_text("workdir")?,
        files: from_json(&row.text("files")?, "sweep files")?,
        slurm: row
            .opt_text("slurm")?
            .map(|j| from_json(&j, "sweep slurm"))
            .transpose()?,
        started_at: row.opt_real("started_at")?,
        data_path: row
            .opt_text("data_path")?
            .map(|j| from_json(&j, "sweep data_path"))
            .transpose()?,
        user_hold: row.boolean("user_hold")?,
        begin_at: row.opt_real("begin_at")?,
        prelude_seconds: row.opt_real("prelude_seconds")?,
    })
}

fn cell(row: &impl Column) -> Result<CellRow> {
    Ok(CellRow {
        sweep_id: row.text("sweep_id")?,
        idx: unsigned(row.int("idx")?, "idx")?,
        value: row.text("value")?,
        state: row.text("state")?.parse()?,
        attempts: unsigned(row.int("attempts")?, "attempts")?,
        claim_id: row.opt_text("claim_id")?,
        claim_epoch: unsigned(row.int("claim_epoch")?, "claim_epoch")?,
        lease_expires_at: row.opt_real("lease_expires_at")?,
        claimed_by: row.opt_text("claimed_by")?,
        started_at: row.opt_real("started_at")?,
        finished_at: row.opt_real("finished_at")?,
        exit_code: row
            .opt_int("exit_code")?
            .map(|v| i32::try_from(v).map_err(|_| StoreError::Corrupt(format!("exit_code = {v}"))))
            .transpose()?,
        elapsed_ms: row
            .opt_int("elapsed_ms")?
            .map(|v| unsigned(v, "elapsed_ms"))
            .transpose()?,
        stdout_tail: row.opt_text("stdout_tail")?,
        stderr_tail: row.opt_text("stderr_tail")?,
        collected: row
            .opt_text("collected")?
            .map(|j| from_json(&j, "cell collected"))
            .transpose()?,
        sandbox_id: row.opt_text("sandbox_id")?,
        cpu_seconds: row.real("cpu_seconds")?,
        gib_seconds: row.real("gib_seconds")?,
        cost_usd: row.real("cost_usd")?,
        error: row.opt_text("error")?,
        signal: row
            .opt_int("signal")?
            .map(|v| i32::try_from(v).map_err(|_| StoreError::Corrupt(format!("signal = {v}"))))
            .transpose()?,
        output_truncated: row.boolean("output_truncated")?,
        max_rss_kib: row
            .opt_int("max_rss_kib")?
            .map(|v| unsigned(v, "max_rss_kib"))
            .transpose()?,
        task_cpu_ms: row
            .opt_int("task_cpu_ms")?
            .map(|v| unsigned(v, "task_cpu_ms"))
            .transpose()?,
        timings: row
            .opt_text("timings")?
            .map(|j| from_json(&j, "cell timings"))
            .transpose()?,
        cancel_requested: row.boolean("cancel_requested")?,
    })
}

fn claim(sweep_id: &str, row: &impl Column, lease_expires_at: f64) -> Result<Claim> {
    Ok(Claim {
        sweep_id: sweep_id.to_owned(),
        idx: unsigned(row.int("idx")?, "idx")?,
        value: row.text("value")?,
        claim_id: row.text("claim_id")?,
        epoch: unsigned(row.int("claim_epoch")?, "claim_epoch")?,
        attempt: unsigned(row.int("attempts")?, "attempts")?,
        lease_expires_at,
    })
}

/// What [`measure_claims`] measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimRate {
    pub backend: String,
    pub cells: usize,
    pub claimers: usize,
    /// Cells asked for per claim.
    pub batch: u32,
    /// From the first claim to the last finish.
    pub seconds: f64,
    /// Cells claimed and finished per second.
    pub claims_per_second: f64,
}

/// Claim throughput, for `shoal bench sweep`: makes a fresh sweep of
/// `cells` cells owned by `account_id` (throttle = `cells`, so only the
/// database limits), then `claimers` concurrent claimers each claim `batch`
/// cells of it at a time and finish every claim `succeeded`, until none is
/// pending. Times from the first claim to the last finish; the sweep's
/// creation is not timed. Touches no other sweep; leaves the measured one in
/// the database, `done`.
pub async fn measure_claims(
    store: &Store,
    account_id: i64,
    cells: usize,
    claimers: usize,
    batch: u32,
) -> Result<ClaimRate> {
    let id = format!("bench-{}", &random_token()[..16]);
    let new = NewSweep {
        id: id.clone(),
        account_id,
        name: "bench claims".to_owned(),
        template: "bench".to_owned(),
        command: "true".to_owned(),
        env: Metadata::new(),
        cells: (0..cells).map(|i| i.to_string()).collect(),
        throttle: u32::try_from(cells).unwrap_or(u32::MAX),
        timeout_seconds: 60,
        max_attempts: 1,
        ..NewSweep::default()
    };
    store.create_sweep(&new, unix_now()).await?;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..claimers.max(1) {
        let store = store.clone();
        let id = id.clone();
        tasks.spawn(async move {
            let runner = format!("bench-{n}");
            loop {
                let claims = store
                    .claim_cells(
                        &runner,
                        Some(&id),
                        batch.max(1),
                        Duration::from_secs(60),
                        unix_now(),
                    )
                    .await?;
                if claims.is_empty() {
                    return Ok::<_, StoreError>(());
                }
                for c in claims {
                    let outcome = CellOutcome::new(CellEnd::Succeeded, unix_now());
                    store.finish_cell(&id, c.idx, &c.claim_id, &outcome).await?;
                }
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.expect("a claimer task panicked")?;
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(ClaimRate {
        backend: store.backend().to_owned(),
        cells,
        claimers,
        batch,
        seconds,
        claims_per_second: cells as f64 / seconds,
    })
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
