//! The front's limits on tenants (`shoal_fleet::limits`), over real HTTP
//! and a real database (each case on SQLite and, with
//! `SHOAL_TEST_DATABASE_URL`, PostgreSQL: `scripts/with-postgres`):
//!
//! - a request without a valid token is refused 401 before its body is
//!   read: a 60 MiB chunked upload produced slowly gets its 401 after a
//!   few chunks, on every kind of tenant route;
//! - once authenticated, a create's body past 1 MiB is 413; a body for any
//!   agent may be larger;
//! - 20 invalid tokens from one address within a minute, and that address
//!   gets 429 with Retry-After for everything that needs a token, without
//!   the database being asked; another address with a good token is not
//!   held to it (the test's two clients bind 127.0.0.2 and 127.0.0.1);
//! - an account past its request rate gets 429 with Retry-After and
//!   `{"error"}`; another account does not.
//!
//! The agent is a stand-in that answers with its name and the size of the
//! body it was sent.

mod common;

use common::{now, stand_in};
use serde_json::{json, Value};
use shoal_fleet::front::{self, Front, FrontConfig};
use shoal_fleet::limits::{AccountRate, FrontLimits};
use shoal_store::{HostReport, Store, Tier};
use shoal_testkit::TestDb;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Fleet {
    db: TestDb,
    store: Store,
    base: String,
}

impl Fleet {
    /// A front with `limits` over `db`, served as `shoal server` serves it
    /// (with the peer's address), and one live stand-in agent.
    async fn start(db: TestDb, limits: FrontLimits) -> Fleet {
        let store = Store::connect(&db.url).await.unwrap();
        let h1 = stand_in("h1").await;
        store
            .report_host(
                &HostReport {
                    id: "h1".into(),
                    url: h1,
                    vcpus: 2,
                    cpu_busy: 0.0,
                    memory_mib: 16_000,
                    available_mib: 14_000,
                    reserve_mib: 1_024,
                    sandboxes: 0,
                    max_sandboxes: None,
                    pss_mib: 0,
                    draining: false,
                },
                now(),
            )
            .await
            .unwrap();
        let front = Front::with_limits(
            store.clone(),
            FrontConfig {
                agent_ca: None,
                fleet_token: "fleet-token-of-the-test".into(),
                database_url: db.url.clone(),
                lost_check: Duration::from_secs(3600),
            },
            limits,
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                front::router(front).into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap();
        });
        Fleet {
            db,
            store,
            base: format!("http://{address}"),
        }
    }

    async fn stop(self) {
        self.store.close().await;
        self.db.cleanup().await;
    }
}

/// A client whose connections come from `source` (any 127/8 address is
/// this machine's loopback on Linux).
fn client_from(source: Ipv4Addr) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(IpAddr::V4(source))
        .build()
        .unwrap()
}

const CHUNK: usize = 64 << 10;
const UPLOAD: usize = 60 << 20;

/// A 60 MiB body produced 64 KiB at once, then 64 KiB every 5 ms (about
/// 5 s for all of it), counting what the client has pulled from it.
fn slow_upload(pulled: Arc<AtomicUsize>) -> reqwest::Body {
    let chunks = futures::stream::unfold(0usize, move |sent| {
        let pulled = pulled.clone();
        async move {
            if sent >= UPLOAD {
                return None;
            }
            if sent > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            pulled.fetch_add(CHUNK, Ordering::SeqCst);
            Some((
                Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; CHUNK])),
                sent + CHUNK,
            ))
        }
    });
    reqwest::Body::wrap_stream(chunks)
}

async fn unauthenticated_uploads_are_refused_before_their_body_is_read(fleet: &Fleet) {
    let http = reqwest::Client::new();
    let routes = [
        (reqwest::Method::POST, "/v1/sandboxes"),
        (reqwest::Method::POST, "/v1/apps"),
        (reqwest::Method::POST, "/v1/volumes"),
        (reqwest::Method::DELETE, "/v1/volumes/data"),
        (
            reqwest::Method::PUT,
            "/v1/sandboxes/sb-000000000001/fs?path=/a",
        ),
        (reqwest::Method::POST, "/v1/sweeps"),
    ];
    for (method, path) in routes {
        for token in [None, Some("not-a-token")] {
            let pulled = Arc::new(AtomicUsize::new(0));
            let mut request = http
                .request(method.clone(), format!("{}{path}", fleet.base))
                .body(slow_upload(pulled.clone()));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let started = Instant::now();
            let answer = tokio::time::timeout(Duration::from_secs(30), request.send())
                .await
                .unwrap_or_else(|_| panic!("{method} {path}: no answer in 30 s"))
                .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
            let took = started.elapsed();
            let pulled_then = pulled.load(Ordering::SeqCst);
            let status = answer.status();
            let body: Value = answer.json().await.unwrap();
            assert_eq!(
                status,
                reqwest::StatusCode::UNAUTHORIZED,
                "{method} {path} {token:?}: {body}"
            );
            assert!(body["error"].as_str().unwrap().contains("token"), "{body}");
            assert!(
                pulled_then < 4 << 20,
                "{method} {path} {token:?}: {pulled_then} bytes produced before the 401"
            );
            assert!(
                took < Duration::from_secs(2),
                "{method} {path} {token:?}: 401 after {took:?}"
            );
            eprintln!(
                "{method} {path} {token:?}: 401 after {took:?}, {pulled_then} bytes produced"
            );
        }
    }
}

async fn bodies_are_bounded_once_authenticated(fleet: &Fleet) {
    let token = fleet.store.create_token("alice", Tier::Team).await.unwrap();
    let http = reqwest::Client::new();
    let post = |path: &str| {
        http.post(format!("{}{path}", fleet.base))
            .bearer_auth(&token)
    };
    let big = vec![b' '; 2 << 20];
    // Declared and chunked, a create past 1 MiB is 413.
    for path in ["/v1/sandboxes", "/v1/apps", "/v1/volumes"] {
        let declared = post(path).body(big.clone()).send().await.unwrap();
        assert_eq!(
            declared.status(),
            reqwest::StatusCode::PAYLOAD_TOO_LARGE,
            "{path}"
        );
        let body: Value = declared.json().await.unwrap();
        assert!(
            body["error"].as_str().unwrap().contains("exceeds"),
            "{body}"
        );
        let chunks = futures::stream::iter(
            big.chunks(CHUNK)
                .map(|c| Ok::<_, std::io::Error>(axum::body::Bytes::copy_from_slice(c)))
                .collect::<Vec<_>>(),
        );
        let chunked = post(path)
            .body(reqwest::Body::wrap_stream(chunks))
            .send()
            .await
            .unwrap();
        assert_eq!(
            chunked.status(),
            reqwest::StatusCode::PAYLOAD_TOO_LARGE,
            "{path} chunked"
        );
    }
    // A create within the bound reaches the agent whole.
    let create = json!({"template": "base"}).to_string();
    let answer: Value = post("/v1/sandboxes")
        .body(create.clone())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["host"], "h1", "{answer}");
    assert_eq!(answer["body_bytes"], create.len());
    // What goes to any agent may be larger.
    let answer: Value = post("/v1/sweeps")
        .body(big.clone())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["body_bytes"], big.len(), "{answer}");
}

async fn bad_tokens_from_one_address_are_refused_429(fleet: &Fleet) {
    let token = fleet.store.create_token("alice", Tier::Free).await.unwrap();
    let attacker = client_from(Ipv4Addr::new(127, 0, 0, 2));
    let user = client_from(Ipv4Addr::LOCALHOST);
    let me = format!("{}/v1/me", fleet.base);

    for i in 0..20 {
        let answer = attacker
            .get(&me)
            .bearer_auth(format!("wrong-{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            answer.status(),
            reqwest::StatusCode::UNAUTHORIZED,
            "attempt {i}"
        );
    }
    // The 21st, and anything else from there that needs a token, good
    // tokens and creates included.
    for (method, path, token) in [
        (reqwest::Method::GET, "/v1/me", Some("wrong-20")),
        (reqwest::Method::GET, "/v1/me", Some(token.as_str())),
        (reqwest::Method::GET, "/v1/me", None),
        (reqwest::Method::POST, "/v1/sandboxes", Some(token.as_str())),
        (
            reqwest::Method::GET,
            "/v1/sandboxes/sb-000000000001",
            Some(token.as_str()),
        ),
    ] {
        let mut request = attacker.request(method.clone(), format!("{}{path}", fleet.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let answer = request.send().await.unwrap();
        assert_eq!(
            answer.status(),
            reqwest::StatusCode::TOO_MANY_REQUESTS,
            "{method} {path}"
        );
        let wait: u64 = answer.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&wait), "Retry-After: {wait}");
        let body: Value = answer.json().await.unwrap();
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("invalid API token"),
            "{body}"
        );
    }
    // What needs no token still answers there.
    let health = attacker
        .get(format!("{}/healthz", fleet.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), reqwest::StatusCode::OK);
    let openapi: Value = attacker
        .get(format!("{}/v1/openapi.json", fleet.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        openapi["host"], "h1",
        "forwarded without a token: {openapi}"
    );

    // Another address: a good token works, a bad one is a plain 401.
    let answer: Value = user
        .get(&me)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["host"], "h1", "{answer}");
    assert_eq!(answer["path"], "/v1/me");
    let answer = user.get(&me).bearer_auth("wrong").send().await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::UNAUTHORIZED);

    // The refusal asks no database: with the store closed, the blocked
    // address still gets its 429 while an unknown token from another
    // address needs the database (500).
    fleet.store.close().await;
    let answer = attacker
        .get(&me)
        .bearer_auth("wrong-21")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    let answer = user
        .get(&me)
        .bearer_auth("wrong-again")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::INTERNAL_SERVER_ERROR);
}

async fn an_account_past_its_rate_is_refused_429(fleet: &Fleet) {
    let alice = fleet.store.create_token("alice", Tier::Pro).await.unwrap();
    let bob = fleet.store.create_token("bob", Tier::Pro).await.unwrap();
    let http = reqwest::Client::new();
    let me = format!("{}/v1/me", fleet.base);
    for i in 0..3 {
        let answer = http.get(&me).bearer_auth(&alice).send().await.unwrap();
        assert_eq!(answer.status(), reqwest::StatusCode::OK, "request {i}");
    }
    for (method, path) in [
        (reqwest::Method::GET, "/v1/me"),
        (reqwest::Method::POST, "/v1/sandboxes"),
        (reqwest::Method::GET, "/v1/sandboxes/sb-000000000001"),
    ] {
        let answer = http
            .request(method.clone(), format!("{}{path}", fleet.base))
            .bearer_auth(&alice)
            .body(json!({"template": "base"}).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(
            answer.status(),
            reqwest::StatusCode::TOO_MANY_REQUESTS,
            "{method} {path}"
        );
        assert_eq!(answer.headers()["retry-after"], "1");
        let body: Value = answer.json().await.unwrap();
        assert!(
            body["error"].as_str().unwrap().contains("rate limit"),
            "{body}"
        );
    }
    // Bob has his own bucket.
    let answer = http.get(&me).bearer_auth(&bob).send().await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    // A second later alice has one request again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let answer = http.get(&me).bearer_auth(&alice).send().await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
}

/// `/v1/me/tokens` is answered by the front itself (the stand-in agent
/// never sees it): a token made there works at once through every way of
/// presenting one, and once revoked it is refused at once.
async fn tokens_are_answered_by_the_front(fleet: &Fleet) {
    let alice = fleet.store.create_token("alice", Tier::Pro).await.unwrap();
    let http = reqwest::Client::new();
    let tokens = format!("{}/v1/me/tokens", fleet.base);
    let made: Value = http
        .post(&tokens)
        .header("X-API-Key", &alice)
        .json(&json!({"label": "ci", "expires_in_days": 7}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = made["token"]
        .as_str()
        .expect("the secret, once")
        .to_string();
    let prefix = made["prefix"].as_str().unwrap().to_string();
    assert!(token.starts_with(&prefix), "{made}");
    assert_eq!(made["label"], "ci");
    assert!(made["expires_at"].is_string(), "{made}");
    let listed: Value = http
        .get(format!("{tokens}?access_token={token}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let items = listed["items"].as_array().expect("{listed}");
    assert!(
        items.iter().any(|t| t["prefix"] == prefix.as_str()),
        "{listed}"
    );
    assert!(items.iter().all(|t| t.get("token").is_none()), "{listed}");
    for bad in [json!({"label": 7}), json!({"expires_in_days": 0})] {
        let answer = http
            .post(&tokens)
            .bearer_auth(&alice)
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), reqwest::StatusCode::BAD_REQUEST, "{bad}");
    }
    let answer = http
        .post(&tokens)
        .bearer_auth(&alice)
        .body("[1]")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::BAD_REQUEST);
    // The new token works at once, then is refused at once once revoked.
    let revoke = |prefix: &str| {
        http.delete(format!("{tokens}/{prefix}"))
            .bearer_auth(&alice)
            .send()
    };
    let me = format!("{}/v1/me", fleet.base);
    let answer = http.get(&me).bearer_auth(&token).send().await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    let answer = revoke(&prefix).await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::NO_CONTENT);
    let answer = http.get(&me).bearer_auth(&token).send().await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::UNAUTHORIZED);
    let answer = revoke(&prefix).await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::NOT_FOUND);
    // Another account cannot see or revoke alice's tokens.
    let bob = fleet.store.create_token("bob", Tier::Pro).await.unwrap();
    let listed: Value = http
        .get(&tokens)
        .bearer_auth(&bob)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let alices = fleet
        .store
        .account_tokens(fleet.store.authenticate(&alice).await.unwrap().unwrap().id)
        .await
        .unwrap();
    for theirs in &alices {
        assert!(
            !listed["items"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["prefix"] == theirs.prefix.as_str()),
            "{listed}"
        );
        let answer = http
            .delete(format!("{tokens}/{}", theirs.prefix))
            .bearer_auth(&bob)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), reqwest::StatusCode::NOT_FOUND);
    }
    let answer = http.get(&tokens).send().await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::UNAUTHORIZED);
}

fn slow_account_limits() -> FrontLimits {
    let mut limits = FrontLimits::default();
    limits.account_rates.insert(
        Tier::Pro,
        AccountRate {
            per_second: 1.0,
            burst: 3,
        },
    );
    limits
}

/// The web console's pages are the front's own (never forwarded), served
/// without a token; what they call goes through the API as any client's.
async fn the_console_is_served_by_the_front(fleet: &Fleet) {
    let http = reqwest::Client::new();
    for (path, kind) in [("/", "text/html"), ("/console/app.js", "text/javascript")] {
        let answer = http
            .get(format!("{}{path}", fleet.base))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), reqwest::StatusCode::OK, "{path}");
        let headers = answer.headers();
        assert!(headers["content-type"].to_str().unwrap().starts_with(kind));
        assert!(headers["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("frame-ancestors 'none'"));
    }
    let answer = http
        .get(format!("{}/v1/sandboxes", fleet.base))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::UNAUTHORIZED);
}

/// Each case as `sqlite::NAME` and `postgres::NAME`, on a front with the
/// limits given.
macro_rules! cases {
    ($($name:ident: $limits:expr),* $(,)?) => {
        mod sqlite {
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let fleet = Fleet::start(TestDb::sqlite().await, $limits).await;
                    super::$name(&fleet).await;
                    fleet.stop().await;
                }
            )*
        }
        mod postgres {
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    if let Some(db) = TestDb::postgres().await {
                        let fleet = Fleet::start(db, $limits).await;
                        super::$name(&fleet).await;
                        fleet.stop().await;
                    }
                }
            )*
        }
    };
}

cases!(
    unauthenticated_uploads_are_refused_before_their_body_is_read: FrontLimits::default(),
    bodies_are_bounded_once_authenticated: FrontLimits::default(),
    bad_tokens_from_one_address_are_refused_429: FrontLimits::default(),
    an_account_past_its_rate_is_refused_429: slow_account_limits(),
    tokens_are_answered_by_the_front: FrontLimits::default(),
    the_console_is_served_by_the_front: FrontLimits::default(),
);
