//! Usage metering: one row per sample, summed per sandbox on demand and
//! priced with the store's [`RateCard`](crate::RateCard).
//!
//! The metadata filter runs in Rust on the summed rows (one per sandbox, so
//! few): metadata is JSON text, and matching it in SQL would mean a different
//! JSON dialect per backend.

use crate::row::{self, Column};
use crate::{on_reader, on_writer, Result, Store, UsageQuery, UsageReport, UsageRow, UsageSample};

const INSERT: &str =
    "INSERT INTO usage_samples (sandbox_id, at, cpu_seconds, gib_seconds, interval_s) \
     VALUES ($1, $2, $3, $4, $5)";

const SUMS: &str = "SELECT s.id AS sandbox_id, s.template AS template, s.metadata AS metadata, \
     SUM(u.cpu_seconds) AS cpu_seconds, SUM(u.gib_seconds) AS gib_seconds \
     FROM usage_samples u JOIN sandboxes s ON s.id = u.sandbox_id \
     WHERE s.account_id = $1 AND u.at >= $2 AND u.at < $3 AND ($4 IS NULL OR s.id = $4) \
     GROUP BY s.id, s.template, s.metadata, s.created_at \
     ORDER BY s.created_at, s.id";

impl Store {
    /// Adds one interval's usage of one sandbox.
    pub async fn record_usage(&self, sample: &UsageSample) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(INSERT)
                .bind(&sample.sandbox_id)
                .bind(sample.at)
                .bind(sample.cpu_seconds)
                .bind(sample.gib_seconds)
                .bind(sample.interval_s)
                .execute(pool)
                .await?;
        });
        Ok(())
    }

    /// The account's usage per sandbox over the query's window, with cost,
    /// and the total of the rows returned.
    pub async fn usage(&self, account_id: i64, query: &UsageQuery) -> Result<UsageReport> {
        let from = query.from.unwrap_or(f64::MIN);
        let to = query.to.unwrap_or(f64::MAX);
        let found: Vec<(String, String, String, f64, f64)> = on_reader!(self, pool => {
            sqlx::query(SUMS)
                .bind(account_id)
                .bind(from)
                .bind(to)
                .bind(&query.sandbox_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| -> Result<_> {
                    Ok((
                        r.text("sandbox_id")?,
                        r.text("template")?,
                        r.text("metadata")?,
                        r.real("cpu_seconds")?,
                        r.real("gib_seconds")?,
                    ))
                })
                .collect::<Result<_>>()?
        });
        let mut report = UsageReport::default();
        for (sandbox_id, template, metadata, cpu_seconds, gib_seconds) in found {
            let metadata = row::metadata_from_json(&metadata)?;
            let wanted = query
                .metadata
                .iter()
                .all(|(k, v)| metadata.get(k) == Some(v));
            if !wanted {
                continue;
            }
            let cost_usd = self.rate_card.cost(cpu_seconds, gib_seconds);
            report.total.cpu_seconds += cpu_seconds;
            report.total.gib_seconds += gib_seconds;
            report.total.cost_usd += cost_usd;
            report.rows.push(UsageRow {
                sandbox_id,
                template,
                metadata,
                cpu_seconds,
                gib_seconds,
                cost_usd,
            });
        }
        Ok(report)
    }
}
