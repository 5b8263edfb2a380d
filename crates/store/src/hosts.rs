//! The fleet's hosts and the placements made on them.
//!
//! A host row is written only on behalf of its own agent
//! ([`Store::report_host`], at registration and every heartbeat), so agents
//! never touch one another's rows. A placement row is a create a control
//! plane sent to a host: it counts against that host's last report while
//! the create is in flight and, once done, until a report made after it
//! arrives; then the report shows the sandbox itself. This is what keeps a
//! burst of creates between two heartbeats from landing on one host.
//! Choosing the host is not done here (see the `shoal-placement` crate).

use crate::row::{signed, unsigned, Column};
use crate::{on_reader, on_writer, HostReport, HostRow, NewPlacement, Result, Store};

/// A placement whose create never reported back (its control plane died)
/// stops counting after this long.
pub const PLACEMENT_TIMEOUT_SECONDS: f64 = 120.0;

const REPORT: &str = "INSERT INTO hosts (id, url, vcpus, cpu_busy, memory_mib, available_mib, \
     reserve_mib, sandboxes, max_sandboxes, pss_mib, draining, registered_at, heartbeat_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $12) \
     ON CONFLICT (id) DO UPDATE SET url = excluded.url, vcpus = excluded.vcpus, \
     cpu_busy = excluded.cpu_busy, memory_mib = excluded.memory_mib, \
     available_mib = excluded.available_mib, reserve_mib = excluded.reserve_mib, \
     sandboxes = excluded.sandboxes, max_sandboxes = excluded.max_sandboxes, \
     pss_mib = excluded.pss_mib, draining = excluded.draining, \
     heartbeat_at = excluded.heartbeat_at";
/// Placements the new report shows, and those whose create was abandoned.
const FORGET_PLACEMENTS: &str = "DELETE FROM placements WHERE host_id = $1 \
     AND ((done_at IS NOT NULL AND done_at <= $2) OR (done_at IS NULL AND created_at < $3))";
const HOSTS: &str = "SELECT h.id, h.url, h.vcpus, h.cpu_busy, h.memory_mib, h.available_mib, \
     h.reserve_mib, h.sandboxes, h.max_sandboxes, h.pss_mib, h.draining, h.drained, \
     h.registered_at, h.heartbeat_at, COUNT(p.id) AS in_flight_sandboxes, \
     CAST(COALESCE(SUM(p.memory_mib), 0) AS BIGINT) AS in_flight_memory_mib, \
     COALESCE(SUM(p.cpu_share), 0.0) AS in_flight_cpu_share \
     FROM hosts h LEFT JOIN placements p ON p.host_id = h.id \
     AND (p.done_at IS NULL OR p.done_at > h.heartbeat_at) AND p.created_at >= $1 \
     GROUP BY h.id, h.url, h.vcpus, h.cpu_busy, h.memory_mib, h.available_mib, h.reserve_mib, \
     h.sandboxes, h.max_sandboxes, h.pss_mib, h.draining, h.drained, h.registered_at, \
     h.heartbeat_at ORDER BY h.id";
const SET_DRAINED: &str = "UPDATE hosts SET drained = $2 WHERE id = $1";
const PLACE: &str = "INSERT INTO placements (id, host_id, memory_mib, cpu_share, created_at) \
     VALUES ($1, $2, $3, $4, $5)";
/// Serialises placement decisions across every front of a fleet (an
/// arbitrary key of Shoal's own); SQLite's `BEGIN IMMEDIATE` does the same.
const LOCK_PLACEMENTS_POSTGRES: &str = "SELECT pg_advisory_xact_lock(7366836657101290337)";
const PLACEMENT_DONE: &str = "UPDATE placements SET done_at = $2 WHERE id = $1";
const DROP_PLACEMENT: &str = "DELETE FROM placements WHERE id = $1";
const LOSE_SANDBOXES: &str = "UPDATE sandboxes SET status = 'lost' \
     WHERE host IN (SELECT id FROM hosts WHERE heartbeat_at < $1) \
     AND status NOT IN ('deleted', 'failed', 'lost') RETURNING id";

impl Store {
    /// Records what a host agent reported at `now` (its registration or a
    /// heartbeat), and forgets the placements the report now shows.
    pub async fn report_host(&self, report: &HostReport, now: f64) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(REPORT)
                .bind(&report.id)
                .bind(&report.url)
                .bind(i64::from(report.vcpus))
                .bind(report.cpu_busy)
                .bind(signed(report.memory_mib))
                .bind(signed(report.available_mib))
                .bind(signed(report.reserve_mib))
                .bind(i64::from(report.sandboxes))
                .bind(report.max_sandboxes.map(i64::from))
                .bind(signed(report.pss_mib))
                .bind(report.draining)
                .bind(now)
                .execute(pool)
                .await?;
            sqlx::query(FORGET_PLACEMENTS)
                .bind(&report.id)
                .bind(now)
                .bind(now - PLACEMENT_TIMEOUT_SECONDS)
                .execute(pool)
                .await?;
        });
        Ok(())
    }

    /// Every host with the placements still counted against it, by id.
    pub async fn hosts(&self, now: f64) -> Result<Vec<HostRow>> {
        on_reader!(self, pool => {
            sqlx::query(HOSTS)
                .bind(now - PLACEMENT_TIMEOUT_SECONDS)
                .fetch_all(pool)
                .await?
                .iter()
                .map(host)
                .collect()
        })
    }

    /// One placement decision, atomic across every front of the fleet:
    /// `choose` sees the hosts with the placements counted against them and
    /// returns the placement to record (or why there is none), and no other
    /// decision reads the hosts between that read and this one's record.
    /// Returns the recorded placement's id, or `choose`'s refusal.
    pub async fn place<E>(
        &self,
        now: f64,
        choose: impl FnOnce(&[HostRow]) -> std::result::Result<NewPlacement, E>,
    ) -> Result<std::result::Result<(NewPlacement, String), E>> {
        let id = format!("pl_{:016x}", rand::random::<u64>());
        let (begin, lock) = match &*self.inner {
            crate::Backend::Sqlite { .. } => ("BEGIN IMMEDIATE", None),
            crate::Backend::Postgres(_) => ("BEGIN", Some(LOCK_PLACEMENTS_POSTGRES)),
        };
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            if let Some(lock) = lock {
                sqlx::query(lock).execute(&mut *tx).await?;
            }
            let hosts: Vec<HostRow> = sqlx::query(HOSTS)
                .bind(now - PLACEMENT_TIMEOUT_SECONDS)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(host)
                .collect::<Result<_>>()?;
            let placement = match choose(&hosts) {
                Ok(placement) => placement,
                Err(refusal) => return Ok(Err(refusal)),
            };
            sqlx::query(PLACE)
                .bind(&id)
                .bind(&placement.host_id)
                .bind(signed(placement.memory_mib))
                .bind(placement.cpu_share)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(Ok((placement, id)))
        })
    }

    /// The create of a placement succeeded at `now`: it counts until the
    /// host's next report.
    pub async fn placement_done(&self, id: &str, now: f64) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(PLACEMENT_DONE).bind(id).bind(now).execute(pool).await?;
        });
        Ok(())
    }

    /// The create of a placement failed: nothing of it is on the host.
    pub async fn drop_placement(&self, id: &str) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(DROP_PLACEMENT).bind(id).execute(pool).await?;
        });
        Ok(())
    }

    /// Drains host `id` (it takes no new sandboxes) or resumes it; false
    /// when there is no such host.
    pub async fn set_host_drained(&self, id: &str, drained: bool) -> Result<bool> {
        on_writer!(self, pool => {
            let done = sqlx::query(SET_DRAINED).bind(id).bind(drained).execute(pool).await?;
            Ok(done.rows_affected() > 0)
        })
    }

    /// Marks `lost` every live sandbox of a host whose last heartbeat is
    /// older than `stale_before`; returns their ids.
    pub async fn lose_sandboxes_of_stale_hosts(&self, stale_before: f64) -> Result<Vec<String>> {
        on_writer!(self, pool => {
            sqlx::query(LOSE_SANDBOXES)
                .bind(stale_before)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok(r.text("id")?))
                .collect()
        })
    }
}

fn host<R: Column>(r: &R) -> Result<HostRow> {
    Ok(HostRow {
        report: HostReport {
            id: r.text("id")?,
            url: r.text("url")?,
            vcpus: unsigned(r.int("vcpus")?, "vcpus")?,
            cpu_busy: r.real("cpu_busy")?,
            memory_mib: unsigned(r.int("memory_mib")?, "memory_mib")?,
            available_mib: unsigned(r.int("available_mib")?, "available_mib")?,
            reserve_mib: unsigned(r.int("reserve_mib")?, "reserve_mib")?,
            sandboxes: unsigned(r.int("sandboxes")?, "sandboxes")?,
            max_sandboxes: r
                .opt_int("max_sandboxes")?
                .map(|m| unsigned(m, "max_sandboxes"))
                .transpose()?,
            pss_mib: unsigned(r.int("pss_mib")?, "pss_mib")?,
            draining: r.boolean("draining")?,
        },
        drained: r.boolean("drained")?,
        registered_at: r.real("registered_at")?,
        heartbeat_at: r.real("heartbeat_at")?,
        in_flight_sandboxes: unsigned(r.int("in_flight_sandboxes")?, "in_flight_sandboxes")?,
        in_flight_memory_mib: unsigned(r.int("in_flight_memory_mib")?, "in_flight_memory_mib")?,
        in_flight_cpu_share: r.real("in_flight_cpu_share")?,
    })
}
