//! Sandboxes' event logs (`sandbox_events`): what happened to a sandbox,
//! in order, written in batches by the host that runs it and trimmed to
//! the newest [`EVENTS_KEPT`] of each sandbox.

use crate::row::Column;
use crate::{on_reader, on_writer, Result, Store};

/// Events kept per sandbox; older ones are deleted as new ones come.
pub const EVENTS_KEPT: i64 = 1000;

/// One event of one sandbox. `payload` is a JSON object's text.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxEvent {
    /// Increasing across all sandboxes (0 for one not yet written).
    pub id: i64,
    pub sandbox_id: String,
    pub at: f64,
    pub kind: String,
    pub payload: String,
}

const INSERT: &str =
    "INSERT INTO sandbox_events (sandbox_id, at, type, payload) VALUES ($1, $2, $3, $4)";
/// Deletes all but the newest [`EVENTS_KEPT`] events of one sandbox.
const TRIM: &str = "DELETE FROM sandbox_events WHERE sandbox_id = $1 AND id <= \
     (SELECT id FROM sandbox_events WHERE sandbox_id = $1 ORDER BY id DESC LIMIT 1 OFFSET $2)";
/// The newest `$3` events of a sandbox after id `$2`, newest first.
const TAIL: &str = "SELECT id, sandbox_id, at, type, payload FROM sandbox_events \
     WHERE sandbox_id = $1 AND id > $2 AND at >= $4 ORDER BY id DESC LIMIT $3";

impl Store {
    /// Writes `events` in one transaction and trims each sandbox they name.
    pub async fn append_sandbox_events(&self, events: &[SandboxEvent]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let mut touched: Vec<&str> = events.iter().map(|e| e.sandbox_id.as_str()).collect();
        touched.sort_unstable();
        touched.dedup();
        on_writer!(self, pool => {
            let mut tx = pool.begin().await?;
            for event in events {
                sqlx::query(INSERT)
                    .bind(&event.sandbox_id)
                    .bind(event.at)
                    .bind(&event.kind)
                    .bind(&event.payload)
                    .execute(&mut *tx)
                    .await?;
            }
            for sandbox in touched {
                sqlx::query(TRIM).bind(sandbox).bind(EVENTS_KEPT).execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// The last `tail` events of a sandbox (oldest first) with an id above
    /// `after_id` and a time at or after `since`.
    pub async fn sandbox_events(
        &self,
        sandbox_id: &str,
        tail: i64,
        after_id: i64,
        since: f64,
    ) -> Result<Vec<SandboxEvent>> {
        let mut events: Vec<SandboxEvent> = on_reader!(self, pool => {
            let rows = sqlx::query(TAIL)
                .bind(sandbox_id)
                .bind(after_id)
                .bind(tail)
                .bind(since)
                .fetch_all(pool)
                .await?;
            rows.iter()
                .map(|r| {
                    Ok(SandboxEvent {
                        id: r.int("id")?,
                        sandbox_id: r.text("sandbox_id")?,
                        at: r.real("at")?,
                        kind: r.text("type")?,
                        payload: r.text("payload")?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        });
        events.reverse();
        Ok(events)
    }
}
