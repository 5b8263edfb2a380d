//! What the front allows a tenant before any agent sees the request.
//!
//! - Bodies: the caller is authenticated before a body is read, and a body
//!   is then read only up to a bound ([`CREATE_BODY_MAX`] for creates and
//!   requests about a volume, [`FORWARDED_BODY_MAX`] for what goes to any
//!   agent); past it, 413. Requests about one sandbox, snapshot or app are
//!   streamed to their host once authenticated (the agent bounds them).
//! - Failed authentications per source address ([`FailedAuths`]): after
//!   `failed_auth_limit` requests with an invalid token within
//!   `failed_auth_window`, every request from that address that needs a
//!   token is 429 with `Retry-After` for `failed_auth_block`, answered
//!   before the token is looked at (no database lookup). IPv6 addresses
//!   count per /64. The table holds at most `tracked_addresses` entries;
//!   past that the oldest goes.
//! - A request rate per account ([`AccountRates`]): a token bucket per
//!   account, per tier ([`AccountRate::default_for`]); past it, 429 with
//!   `Retry-After` and `{"error"}`. The SDK retries a create's 429 that
//!   carries `Retry-After`; the quota 429s of the agents carry none and are
//!   not retried, so the two stay apart.

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{header, Extensions, HeaderMap, StatusCode};
use axum::response::Response;
use shoal_store::{Account, Tier};
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A create's body (sandbox, app, volume) and a request about one volume:
/// the agents refuse JSON bodies past 1 MiB too.
pub const CREATE_BODY_MAX: usize = 1 << 20;
/// A body the front holds to send to any agent (sweeps, lists, usage).
pub const FORWARDED_BODY_MAX: usize = 64 << 20;

/// Routes an agent serves without a token; the front forwards them without
/// one too (`/healthz` the front answers itself).
pub fn is_open(path: &str) -> bool {
    matches!(path, "/healthz" | "/version" | "/v1/openapi.json")
}

/// One account's request rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AccountRate {
    /// Requests per second, sustained.
    pub per_second: f64,
    /// Requests at once after a quiet spell.
    pub burst: u32,
}

impl AccountRate {
    /// Generous: a burst of 200 covers 100 creates fired at once (the SDK
    /// suite's quota race) with room for the lists around them.
    pub fn default_for(tier: Tier) -> AccountRate {
        match tier {
            Tier::Free => AccountRate {
                per_second: 50.0,
                burst: 200,
            },
            Tier::Pro => AccountRate {
                per_second: 100.0,
                burst: 400,
            },
            Tier::Team => AccountRate {
                per_second: 200.0,
                burst: 800,
            },
        }
    }
}

/// The front's limits on tenants (see the module's documentation).
#[derive(Debug, Clone)]
pub struct FrontLimits {
    /// Overrides of [`AccountRate::default_for`].
    pub account_rates: HashMap<Tier, AccountRate>,
    /// Invalid tokens from one address within `failed_auth_window` before
    /// it is refused.
    pub failed_auth_limit: u32,
    pub failed_auth_window: Duration,
    /// How long an address is refused once over the limit.
    pub failed_auth_block: Duration,
    /// Addresses remembered at most (the oldest goes first).
    pub tracked_addresses: usize,
    /// Accounts whose bucket is remembered at most (the oldest goes first;
    /// a forgotten bucket starts full again).
    pub tracked_accounts: usize,
}

impl Default for FrontLimits {
    fn default() -> FrontLimits {
        FrontLimits {
            account_rates: HashMap::new(),
            failed_auth_limit: 20,
            failed_auth_window: Duration::from_secs(60),
            failed_auth_block: Duration::from_secs(60),
            tracked_addresses: 10_000,
            tracked_accounts: 10_000,
        }
    }
}

impl FrontLimits {
    /// Sets one tier's rate from `TIER=PER_SECOND/BURST` (`free=10/50`),
    /// as `shoal server --account-rate` takes it.
    pub fn set_account_rate(&mut self, spec: &str) -> Result<(), String> {
        let bad = || format!("{spec:?}: want TIER=PER_SECOND/BURST, e.g. free=10/50");
        let (tier, rate) = spec.split_once('=').ok_or_else(bad)?;
        let tier: Tier = tier.trim().parse().map_err(|_| bad())?;
        let (per_second, burst) = rate.split_once('/').ok_or_else(bad)?;
        let per_second: f64 = per_second.trim().parse().map_err(|_| bad())?;
        let burst: u32 = burst.trim().parse().map_err(|_| bad())?;
        if !per_second.is_finite() || per_second < 0.0 || burst == 0 {
            return Err(bad());
        }
        self.account_rates
            .insert(tier, AccountRate { per_second, burst });
        Ok(())
    }

    pub fn account_rate(&self, tier: Tier) -> AccountRate {
        self.account_rates
            .get(&tier)
            .copied()
            .unwrap_or_else(|| AccountRate::default_for(tier))
    }
}

/// A map of at most `cap` entries that forgets the oldest inserted first.
struct Bounded<K, V> {
    cap: usize,
    map: HashMap<K, V>,
    order: VecDeque<K>,
}

impl<K: Hash + Eq + Clone, V> Bounded<K, V> {
    fn new(cap: usize) -> Self {
        Bounded {
            cap: cap.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn get(&self, key: &K) -> Option<&V> {
        self.map.get(key)
    }

    /// The entry of `key`, made by `make` (evicting the oldest entry when
    /// full) when there is none.
    fn entry(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        if !self.map.contains_key(&key) {
            while self.map.len() >= self.cap {
                match self.order.pop_front() {
                    Some(oldest) => {
                        self.map.remove(&oldest);
                    }
                    None => break,
                }
            }
            self.order.push_back(key.clone());
        }
        self.map.entry(key).or_insert_with(make)
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// The source address of a request, when the server was started with
/// `into_make_service_with_connect_info::<SocketAddr>()`.
pub fn source(extensions: &Extensions) -> Option<IpAddr> {
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(address)| address.ip())
}

/// What one address is counted as: an IPv4 address (also when mapped into
/// IPv6) or an IPv6 /64, the least one holder of IPv6 addresses has.
fn address_key(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

struct Failures {
    since: Instant,
    count: u32,
    blocked_until: Option<Instant>,
}

/// Invalid tokens per source address.
pub struct FailedAuths {
    limit: u32,
    window: Duration,
    block: Duration,
    table: Mutex<Bounded<IpAddr, Failures>>,
}

impl FailedAuths {
    pub fn new(limits: &FrontLimits) -> FailedAuths {
        FailedAuths {
            limit: limits.failed_auth_limit.max(1),
            window: limits.failed_auth_window,
            block: limits.failed_auth_block,
            table: Mutex::new(Bounded::new(limits.tracked_addresses)),
        }
    }

    /// How long `source` is still refused, if it is.
    pub fn blocked(&self, source: IpAddr, now: Instant) -> Option<Duration> {
        let table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let until = table.get(&address_key(source))?.blocked_until?;
        (now < until).then(|| until - now)
    }

    /// Counts an invalid token from `source`.
    pub fn failed(&self, source: IpAddr, now: Instant) {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = || Failures {
            since: now,
            count: 0,
            blocked_until: None,
        };
        let entry = table.entry(address_key(source), fresh);
        let block_over = entry.blocked_until.is_some_and(|until| now >= until);
        let window_over = entry.blocked_until.is_none()
            && now.saturating_duration_since(entry.since) >= self.window;
        if block_over || window_over {
            *entry = fresh();
        }
        entry.count += 1;
        if entry.count >= self.limit && entry.blocked_until.is_none() {
            entry.blocked_until = Some(now + self.block);
        }
    }

    /// Addresses remembered now.
    pub fn tracked(&self) -> usize {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// A token bucket per account.
pub struct AccountRates {
    limits: FrontLimits,
    table: Mutex<Bounded<i64, Bucket>>,
}

impl AccountRates {
    pub fn new(limits: &FrontLimits) -> AccountRates {
        AccountRates {
            limits: limits.clone(),
            table: Mutex::new(Bounded::new(limits.tracked_accounts)),
        }
    }

    /// Takes one request from `account`'s bucket, or says how long until
    /// there is one.
    pub fn take(&self, account: &Account, now: Instant) -> Result<(), Duration> {
        let rate = self.limits.account_rate(account.tier);
        let burst = f64::from(rate.burst.max(1));
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let bucket = table.entry(account.id, || Bucket {
            tokens: burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate.per_second.max(0.0)).min(burst);
        bucket.at = bucket.at.max(now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait = (1.0 - bucket.tokens) / rate.per_second;
        Err(Duration::try_from_secs_f64(wait).unwrap_or(Duration::from_secs(60)))
    }
}

/// Whole seconds to tell a client to wait: at least 1.
fn retry_after_seconds(wait: Duration) -> u32 {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    u32::try_from(seconds.max(1)).unwrap_or(u32::MAX)
}

/// 429 for an address over the failed-authentication limit.
pub fn address_refused(wait: Duration) -> Response {
    crate::refuse(
        StatusCode::TOO_MANY_REQUESTS,
        "too many requests with an invalid API token from this address",
        Some(retry_after_seconds(wait)),
    )
}

/// 429 for an account over its request rate.
pub fn account_refused(wait: Duration) -> Response {
    crate::refuse(
        StatusCode::TOO_MANY_REQUESTS,
        "request rate limit exceeded for this account",
        Some(retry_after_seconds(wait)),
    )
}

/// The whole body, refused with 413 past `limit` bytes (by Content-Length
/// before reading when the client sent one).
pub async fn read_bounded(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, Response> {
    let too_large = || {
        crate::refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body exceeds {limit} bytes"),
            None,
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, limit)
        .await
        .map_err(|e| match declared {
            // Without a declared length, the limit is what stopped the read.
            None => too_large(),
            Some(_) => crate::refuse(
                StatusCode::BAD_REQUEST,
                &format!("reading the request body: {e}"),
                None,
            ),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> FrontLimits {
        FrontLimits {
            failed_auth_limit: 3,
            failed_auth_window: Duration::from_secs(60),
            failed_auth_block: Duration::from_secs(30),
            tracked_addresses: 4,
            ..FrontLimits::default()
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_address_is_refused_after_the_limit_for_the_block_time() {
        let auths = FailedAuths::new(&limits());
        let t0 = Instant::now();
        let bad = ip("192.0.2.1");
        for i in 0..3 {
            assert_eq!(auths.blocked(bad, t0), None, "before failure {i}");
            auths.failed(bad, t0 + Duration::from_secs(i));
        }
        let wait = auths.blocked(bad, t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(wait, Duration::from_secs(30));
        // Another address is not held to it.
        assert_eq!(auths.blocked(ip("192.0.2.2"), t0), None);
        // The block ends, and counting starts over.
        let after = t0 + Duration::from_secs(2 + 30);
        assert_eq!(auths.blocked(bad, after), None);
        auths.failed(bad, after);
        assert_eq!(auths.blocked(bad, after), None);
    }

    #[test]
    fn failures_outside_the_window_do_not_add_up() {
        let auths = FailedAuths::new(&limits());
        let t0 = Instant::now();
        let bad = ip("192.0.2.1");
        auths.failed(bad, t0);
        auths.failed(bad, t0 + Duration::from_secs(1));
        // The third comes after the window: a new window with one failure.
        auths.failed(bad, t0 + Duration::from_secs(61));
        assert_eq!(auths.blocked(bad, t0 + Duration::from_secs(61)), None);
        auths.failed(bad, t0 + Duration::from_secs(62));
        auths.failed(bad, t0 + Duration::from_secs(63));
        assert!(auths.blocked(bad, t0 + Duration::from_secs(63)).is_some());
    }

    #[test]
    fn the_address_table_is_bounded_and_forgets_the_oldest() {
        let auths = FailedAuths::new(&limits());
        let t0 = Instant::now();
        let first = ip("192.0.2.1");
        for _ in 0..3 {
            auths.failed(first, t0);
        }
        assert!(auths.blocked(first, t0).is_some());
        for i in 2..1000 {
            auths.failed(ip(&format!("10.0.{}.{}", i / 256, i % 256)), t0);
            assert!(auths.tracked() <= 4);
        }
        assert_eq!(auths.tracked(), 4);
        assert_eq!(auths.blocked(first, t0), None, "the oldest went");
    }

    #[test]
    fn ipv6_counts_per_slash_64_and_mapped_ipv4_as_ipv4() {
        let auths = FailedAuths::new(&limits());
        let t0 = Instant::now();
        auths.failed(ip("2001:db8:1:2::1"), t0);
        auths.failed(ip("2001:db8:1:2:ffff::9"), t0);
        auths.failed(ip("2001:db8:1:2:abcd::"), t0);
        assert!(auths.blocked(ip("2001:db8:1:2::77"), t0).is_some());
        assert_eq!(auths.blocked(ip("2001:db8:1:3::1"), t0), None);

        for _ in 0..3 {
            auths.failed(ip("::ffff:198.51.100.7"), t0);
        }
        assert!(auths.blocked(ip("198.51.100.7"), t0).is_some());
    }

    fn account(id: i64, tier: Tier) -> Account {
        Account {
            id,
            name: format!("a{id}"),
            tier,
        }
    }

    #[test]
    fn an_account_gets_its_burst_then_its_rate() {
        let mut limits = FrontLimits::default();
        limits.account_rates.insert(
            Tier::Free,
            AccountRate {
                per_second: 2.0,
                burst: 5,
            },
        );
        let rates = AccountRates::new(&limits);
        let (alice, bob) = (account(1, Tier::Free), account(2, Tier::Free));
        let t0 = Instant::now();
        for i in 0..5 {
            assert_eq!(rates.take(&alice, t0), Ok(()), "request {i}");
        }
        let wait = rates.take(&alice, t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert_eq!(retry_after_seconds(wait), 1);
        // Bob has his own bucket.
        assert_eq!(rates.take(&bob, t0), Ok(()));
        // Half a second brings one request back, not more.
        let later = t0 + Duration::from_millis(500);
        assert_eq!(rates.take(&alice, later), Ok(()));
        assert!(rates.take(&alice, later).is_err());
        // A long rest refills up to the burst only.
        let rested = t0 + Duration::from_secs(3600);
        for _ in 0..5 {
            assert_eq!(rates.take(&alice, rested), Ok(()));
        }
        assert!(rates.take(&alice, rested).is_err());
    }

    #[test]
    fn the_defaults_grow_with_the_tier_and_take_a_hundred_at_once() {
        let limits = FrontLimits::default();
        let free = limits.account_rate(Tier::Free);
        assert!(free.burst >= 200 && free.per_second >= 50.0);
        assert!(limits.account_rate(Tier::Pro).burst > free.burst);
        assert!(limits.account_rate(Tier::Team).burst > limits.account_rate(Tier::Pro).burst);
        let rates = AccountRates::new(&limits);
        let t0 = Instant::now();
        let free_account = account(1, Tier::Free);
        for _ in 0..100 {
            assert_eq!(rates.take(&free_account, t0), Ok(()));
        }
    }

    #[test]
    fn a_zero_rate_waits_a_bounded_time() {
        let mut limits = FrontLimits::default();
        limits.account_rates.insert(
            Tier::Team,
            AccountRate {
                per_second: 0.0,
                burst: 1,
            },
        );
        let rates = AccountRates::new(&limits);
        let team = account(1, Tier::Team);
        let t0 = Instant::now();
        assert_eq!(rates.take(&team, t0), Ok(()));
        assert_eq!(rates.take(&team, t0), Err(Duration::from_secs(60)));
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_seconds(Duration::from_secs(30)), 30);
    }

    #[test]
    fn only_health_and_the_api_document_are_open() {
        assert!(is_open("/healthz"));
        assert!(is_open("/v1/openapi.json"));
        assert!(!is_open("/v1/me"));
        assert!(!is_open("/v1/openapi.json/x"));
    }

    #[test]
    fn account_rates_are_set_from_flags() {
        let mut limits = FrontLimits::default();
        limits.set_account_rate("free=10/50").unwrap();
        let free = limits.account_rate(Tier::Free);
        assert_eq!((free.per_second, free.burst), (10.0, 50));
        assert_eq!(
            limits.account_rate(Tier::Team).burst,
            800,
            "others keep theirs"
        );
        for bad in [
            "free",
            "free=10",
            "gold=1/2",
            "free=x/2",
            "free=1/0",
            "free=-1/5",
            "free=NaN/5",
        ] {
            assert!(limits.set_account_rate(bad).is_err(), "{bad}");
        }
    }
}
