//! An operator's commands on the database (any account): tokens listed and
//! revoked, an account's tier changed, every live sandbox listed and one
//! killed. They write the database only; a host acts on what they wrote
//! (a killed sandbox's VM goes at its host's next lifecycle tick, which
//! kills the VM of every row no longer live there).

use crate::up::{close_store, DatabaseArgs};
use anyhow::{Context, Result};
use shoal_store::{status, SandboxPatch, Store, Tier};
use std::path::PathBuf;

/// Where the database is, as `shoal token create` finds it.
#[derive(clap::Args)]
pub struct Db {
    #[command(flatten)]
    database: DatabaseArgs,
    /// Where the default SQLite database lives.
    #[arg(long, env = "SHOAL_STATE_DIR", default_value = "/var/lib/shoal")]
    state_dir: PathBuf,
}

impl Db {
    /// Runs `work` on the database, then closes it whatever `work` gave.
    async fn with<T>(&self, work: impl AsyncFnOnce(&Store) -> Result<T>) -> Result<T> {
        let store = self.open().await?;
        let result = work(&store).await;
        close_store(store).await;
        result
    }

    async fn open(&self) -> Result<Store> {
        let url = self.database.url(&self.state_dir);
        Store::connect(&url)
            .await
            .with_context(|| format!("opening the database {}", crate::up::redacted(&url)))
    }
}

#[derive(clap::Args)]
pub struct TokenListArgs {
    /// The account whose tokens to list.
    #[arg(long)]
    account: String,
    #[command(flatten)]
    db: Db,
}

#[derive(clap::Args)]
pub struct TokenRevokeArgs {
    /// The account the token belongs to.
    #[arg(long)]
    account: String,
    /// The token's prefix, as `shoal token list` shows it.
    prefix: String,
    #[command(flatten)]
    db: Db,
}

#[derive(clap::Args)]
pub struct SetTierArgs {
    /// The account.
    account: String,
    /// free, pro or team.
    tier: String,
    #[command(flatten)]
    db: Db,
}

#[derive(clap::Args)]
pub struct SandboxListArgs {
    /// Only this account's.
    #[arg(long)]
    account: Option<String>,
    #[command(flatten)]
    db: Db,
}

#[derive(clap::Args)]
pub struct SandboxKillArgs {
    /// The sandboxes to kill.
    #[arg(required = true)]
    ids: Vec<String>,
    #[command(flatten)]
    db: Db,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn account_id(store: &Store, name: &str) -> Result<i64> {
    Ok(store
        .account_by_name(name)
        .await?
        .with_context(|| format!("no account {name}"))?
        .id)
}

/// The id of the account a list is narrowed to, if it is.
async fn only_account(store: &Store, name: Option<&str>) -> Result<Option<i64>> {
    match name {
        Some(name) => Ok(Some(account_id(store, name).await?)),
        None => Ok(None),
    }
}

/// Accounts' names by id, each read once.
#[derive(Default)]
struct AccountNames(std::collections::HashMap<i64, String>);

impl AccountNames {
    async fn of(&mut self, store: &Store, id: i64) -> Result<&str> {
        if !self.0.contains_key(&id) {
            let name = store
                .account_by_id(id)
                .await?
                .map_or_else(|| id.to_string(), |a| a.name);
            self.0.insert(id, name);
        }
        Ok(&self.0[&id])
    }
}

fn time(seconds: f64) -> String {
    chrono::DateTime::from_timestamp(seconds as i64, 0).map_or_else(
        || "-".into(),
        |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
    )
}

pub async fn token_list(args: TokenListArgs) -> Result<()> {
    args.db
        .with(async |store| {
            let tokens = store
                .account_tokens(account_id(store, &args.account).await?)
                .await?;
            println!("{:<14} {:<24} {:<20} EXPIRES", "PREFIX", "LABEL", "CREATED");
            for t in tokens {
                println!(
                    "{:<14} {:<24} {:<20} {}",
                    t.prefix,
                    if t.label.is_empty() { "-" } else { &t.label },
                    time(t.created_at),
                    t.expires_at.map_or_else(|| "never".into(), time)
                );
            }
            Ok(())
        })
        .await
}

pub async fn token_revoke(args: TokenRevokeArgs) -> Result<()> {
    args.db
        .with(async |store| {
            let id = account_id(store, &args.account).await?;
            match store.revoke_account_token(id, &args.prefix).await? {
                Ok(_) => {
                    println!("revoked {} (servers refuse it within 10 s)", args.prefix);
                    Ok(())
                }
                Err(shoal_store::TokenRefusal::Ambiguous) => {
                    anyhow::bail!(
                        "more than one token of {} starts with {}",
                        args.account,
                        args.prefix
                    )
                }
                Err(_) => anyhow::bail!("account {} has no token {}", args.account, args.prefix),
            }
        })
        .await
}

pub async fn set_tier(args: SetTierArgs) -> Result<()> {
    let tier: Tier = args.tier.parse().context("the tier is free, pro or team")?;
    args.db
        .with(async |store| {
            anyhow::ensure!(
                store.set_account_tier(&args.account, tier).await?,
                "no account {}",
                args.account
            );
            println!("{}: {tier} (servers apply it within 10 s)", args.account);
            Ok(())
        })
        .await
}

pub async fn sandbox_list(args: SandboxListArgs) -> Result<()> {
    args.db
        .with(async |store| {
            let only = only_account(store, args.account.as_deref()).await?;
            let mut names = AccountNames::default();
            println!(
                "{:<18} {:<12} {:<11} {:<10} {:<18} CREATED",
                "ID", "ACCOUNT", "STATUS", "HOST", "TEMPLATE"
            );
            for row in store.list_all_live().await? {
                if only.is_some_and(|id| id != row.account_id) {
                    continue;
                }
                println!(
                    "{:<18} {:<12} {:<11} {:<10} {:<18} {}",
                    row.id,
                    names.of(store, row.account_id).await?,
                    row.status,
                    row.host.as_deref().unwrap_or("-"),
                    row.template,
                    time(row.created_at)
                );
            }
            Ok(())
        })
        .await
}

pub async fn sandbox_kill(args: SandboxKillArgs) -> Result<()> {
    args.db
        .with(async |store| {
            let mut missing = Vec::new();
            for id in &args.ids {
                let live = store
                    .sandbox_by_id(id)
                    .await?
                    .is_some_and(|row| row.is_live());
                if !live {
                    missing.push(id.as_str());
                    continue;
                }
                let patch = SandboxPatch {
                    status: Some(status::DELETED.into()),
                    status_reason: Some("killed by the operator".into()),
                    deleted_at: Some(now()),
                    ..SandboxPatch::default()
                };
                store.update_sandbox(id, patch).await?;
                println!("{id}: deleted; its host stops the VM at its next lifecycle tick");
            }
            anyhow::ensure!(missing.is_empty(), "no live sandbox {}", missing.join(", "));
            Ok(())
        })
        .await
}

#[derive(clap::Args)]
pub struct HostListArgs {
    #[command(flatten)]
    db: Db,
}

#[derive(clap::Args)]
pub struct HostDrainArgs {
    /// The host, as `shoal host list` names it.
    name: String,
    #[command(flatten)]
    db: Db,
}

/// How long ago a host's heartbeat may be for it to count as up (the
/// fronts' own figure).
const HOST_STALE_AFTER_SECONDS: f64 = 15.0;

pub async fn host_list(args: HostListArgs) -> Result<()> {
    args.db
        .with(async |store| {
            let now = now();
            println!(
                "{:<16} {:<28} {:<9} {:>5} {:>9} {:>9} {:>9} {:>10}",
                "HOST", "URL", "STATE", "VCPUS", "MEM_MIB", "FREE_MIB", "SANDBOXES", "HEARTBEAT"
            );
            for host in store.hosts(now).await? {
                let report = &host.report;
                let state = if host.drained {
                    "drained"
                } else if report.draining {
                    "draining"
                } else if !host.is_fresh(now, HOST_STALE_AFTER_SECONDS) {
                    "silent"
                } else {
                    "up"
                };
                println!(
                    "{:<16} {:<28} {:<9} {:>5} {:>9} {:>9} {:>9} {:>9.0}s",
                    report.id,
                    report.url,
                    state,
                    report.vcpus,
                    report.memory_mib,
                    report.available_mib,
                    report.sandboxes,
                    (now - host.heartbeat_at).max(0.0)
                );
            }
            Ok(())
        })
        .await
}

/// Drains a host (`drained`) or resumes it. A drained host gets no new
/// placements; the sandboxes on it run on until they end, are deleted or
/// idle out (their rows' lifecycles are unchanged).
pub async fn host_drain(args: HostDrainArgs, drained: bool) -> Result<()> {
    args.db
        .with(async |store| {
            let found = store.set_host_drained(&args.name, drained).await?;
            anyhow::ensure!(found, "no host {} (see shoal host list)", args.name);
            if drained {
                println!(
                    "{}: drained; no new sandboxes are placed on it, its own run on",
                    args.name
                );
            } else {
                println!("{}: takes new sandboxes again", args.name);
            }
            Ok(())
        })
        .await
}

#[derive(clap::Args)]
pub struct SnapshotListArgs {
    /// Only this account's.
    #[arg(long)]
    account: Option<String>,
    #[command(flatten)]
    db: Db,
}

#[derive(clap::Args)]
pub struct SnapshotRmArgs {
    /// The snapshots to remove.
    #[arg(required = true)]
    ids: Vec<String>,
    #[command(flatten)]
    db: Db,
}

pub async fn snapshot_list(args: SnapshotListArgs) -> Result<()> {
    args.db
        .with(async |store| {
            let only = only_account(store, args.account.as_deref()).await?;
            let mut names = AccountNames::default();
            println!(
                "{:<22} {:<12} {:<18} {:<18} {:>9} {:<10} {:<20} STATE",
                "ID", "ACCOUNT", "SANDBOX", "TEMPLATE", "MIB", "HOST", "CREATED"
            );
            for (row, removal) in store.list_all_snapshots().await? {
                if only.is_some_and(|id| id != row.account_id) {
                    continue;
                }
                println!(
                    "{:<22} {:<12} {:<18} {:<18} {:>9} {:<10} {:<20} {}",
                    row.id,
                    names.of(store, row.account_id).await?,
                    row.sandbox_id.as_deref().unwrap_or("-"),
                    row.template,
                    row.size_bytes
                        .map_or_else(|| "-".into(), |b| (b >> 20).to_string()),
                    row.host.as_deref().unwrap_or("-"),
                    time(row.created_at),
                    if removal.is_some() {
                        "removing"
                    } else {
                        "kept"
                    }
                );
            }
            Ok(())
        })
        .await
}

/// Asks for the removal of snapshots (any account's): their accounts no
/// longer see them at once; each one's host removes its files, then its
/// record, at its next lifecycle tick.
pub async fn snapshot_rm(args: SnapshotRmArgs) -> Result<()> {
    args.db
        .with(async |store| {
            let mut refused = Vec::new();
            for id in &args.ids {
                let naming = store.templates_of_snapshot(id).await?;
                if !naming.is_empty() {
                    refused.push(format!(
                        "{id}: templates are made from it ({}); remove them first",
                        naming.join(", ")
                    ));
                    continue;
                }
                if store.request_snapshot_removal(id, now()).await? {
                    println!(
                    "{id}: removed from its account; its host deletes the files at its next tick"
                );
                } else {
                    refused.push(format!(
                        "{id}: no such snapshot, or its removal was asked already"
                    ));
                }
            }
            anyhow::ensure!(refused.is_empty(), "{}", refused.join("\n"));
            Ok(())
        })
        .await
}
