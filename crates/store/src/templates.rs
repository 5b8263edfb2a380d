//! An account's own templates: names for its snapshots that sandboxes are
//! created from (issue 21). Every read and delete names the owning account,
//! so one account never sees another's templates, unless an operator
//! published it (read by name, never changed, by the others); a snapshot a template
//! names cannot be deleted (the foreign key, and
//! [`Store::templates_of_snapshot`] for a clear refusal first).

use crate::row::Column;
use crate::sandboxes::{admission_lock, already_exists};
use crate::{on_reader, on_writer, Account, Result, Store, StoreError, TemplateRow};

const COLUMNS: &str =
    "account_id, name, snapshot_id, base, start_cmd, ready_cmd, published, created_at";
const INSERT: &str = "INSERT INTO templates \
     (account_id, name, snapshot_id, base, start_cmd, ready_cmd, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7)";
const DELETE: &str = "DELETE FROM templates WHERE account_id = $1 AND name = $2";
const COUNT: &str = "SELECT COUNT(*) AS n FROM templates WHERE account_id = $1";
const OF_SNAPSHOT: &str = "SELECT name FROM templates WHERE snapshot_id = $1 ORDER BY name";
const PUBLISH: &str = "UPDATE templates SET published = $3 WHERE account_id = $1 AND name = $2";

fn published_sql() -> String {
    format!("SELECT {COLUMNS} FROM templates WHERE published AND name = $1")
}

fn list_published_sql() -> String {
    format!("SELECT {COLUMNS} FROM templates WHERE published ORDER BY name")
}

fn get_sql() -> String {
    format!("SELECT {COLUMNS} FROM templates WHERE account_id = $1 AND name = $2")
}

fn list_sql() -> String {
    format!("SELECT {COLUMNS} FROM templates WHERE account_id = $1 ORDER BY name")
}

fn template(row: &impl Column) -> Result<TemplateRow> {
    Ok(TemplateRow {
        account_id: row.int("account_id")?,
        name: row.text("name")?,
        snapshot_id: row.text("snapshot_id")?,
        base: row.text("base")?,
        start_cmd: row.opt_text("start_cmd")?,
        ready_cmd: row.opt_text("ready_cmd")?,
        published: row.boolean("published")?,
        created_at: row.real("created_at")?,
    })
}

impl Store {
    /// Records `template` for `account` if it holds fewer than `limit`
    /// templates, atomically (the account lock of sandbox admission):
    /// [`StoreError::Quota`] at the limit, [`StoreError::AlreadyExists`]
    /// when it has one of that name. Several templates may name one
    /// snapshot, so the snapshot quota alone would not bound them.
    pub async fn insert_template(
        &self,
        account: &Account,
        template: &TemplateRow,
        limit: u32,
    ) -> Result<()> {
        let (begin, lock) = admission_lock(self);
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            sqlx::query(lock).bind(account.id).fetch_optional(&mut *tx).await?;
            let held = sqlx::query(COUNT).bind(account.id).fetch_one(&mut *tx).await?.int("n")?;
            if held >= i64::from(limit) {
                return Err(StoreError::Quota {
                    message: format!("{} tier allows {limit} templates", account.tier),
                });
            }
            sqlx::query(INSERT)
                .bind(account.id)
                .bind(&template.name)
                .bind(&template.snapshot_id)
                .bind(&template.base)
                .bind(&template.start_cmd)
                .bind(&template.ready_cmd)
                .bind(template.created_at)
                .execute(&mut *tx)
                .await
                .map_err(|e| already_exists(e, "template", &template.name))?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// The account's template called `name`.
    pub async fn get_template(&self, account_id: i64, name: &str) -> Result<Option<TemplateRow>> {
        let sql = get_sql();
        on_reader!(self, pool => {
            sqlx::query(&sql)
                .bind(account_id)
                .bind(name)
                .fetch_optional(pool)
                .await?
                .map(|r| template(&r))
                .transpose()
        })
    }

    /// The account's templates, by name.
    pub async fn list_templates(&self, account_id: i64) -> Result<Vec<TemplateRow>> {
        let sql = list_sql();
        on_reader!(self, pool => {
            sqlx::query(&sql).bind(account_id).fetch_all(pool).await?.iter().map(template).collect()
        })
    }

    /// Deletes the account's template `name` (its snapshot stays); false if
    /// there was none.
    pub async fn delete_template(&self, account_id: i64, name: &str) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(DELETE).bind(account_id).bind(name).execute(pool).await?.rows_affected()
        });
        Ok(affected > 0)
    }

    /// Publishes the account's template `name` to every account (or takes
    /// it back); false if the account has none of that name.
    /// [`StoreError::AlreadyExists`] when another account's published
    /// template has the name.
    pub async fn set_template_published(
        &self,
        account_id: i64,
        name: &str,
        published: bool,
    ) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(PUBLISH)
                .bind(account_id)
                .bind(name)
                .bind(published)
                .execute(pool)
                .await
                .map_err(|e| already_exists(e, "published template", name))?
                .rows_affected()
        });
        Ok(affected > 0)
    }

    /// The published template called `name`, whichever account's it is.
    pub async fn get_published_template(&self, name: &str) -> Result<Option<TemplateRow>> {
        let sql = published_sql();
        on_reader!(self, pool => {
            sqlx::query(&sql)
                .bind(name)
                .fetch_optional(pool)
                .await?
                .map(|r| template(&r))
                .transpose()
        })
    }

    /// Every published template, by name.
    pub async fn list_published_templates(&self) -> Result<Vec<TemplateRow>> {
        let sql = list_published_sql();
        on_reader!(self, pool => {
            sqlx::query(&sql).fetch_all(pool).await?.iter().map(template).collect()
        })
    }

    /// The names of the templates that restore from snapshot `snapshot_id`.
    pub async fn templates_of_snapshot(&self, snapshot_id: &str) -> Result<Vec<String>> {
        on_reader!(self, pool => {
            sqlx::query(OF_SNAPSHOT)
                .bind(snapshot_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| r.text("name").map_err(Into::into))
                .collect()
        })
    }
}
