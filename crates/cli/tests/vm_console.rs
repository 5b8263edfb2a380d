//! The web console in a real browser (Debian's chromium, driven over
//! WebDriver by chromedriver) against a real `shoal up` with real VMs:
//! a wrong token is refused and shows nothing; signed in, a sandbox made
//! through the API appears in the table; its page opens a terminal over
//! the PTY WebSocket in which a typed command runs; a submitted sweep's
//! grid reaches done; the usage page shows the cost; the fleet page lists
//! the host; another account's token sees none of it, not even by the
//! sandbox's address.
//!
//! Screenshots of each page go to `$SHOAL_CONSOLE_SCREENSHOTS` (the
//! committed ones: `docs/console/`), else `target/console-screenshots/`.
//! chromedriver and `shoal up` run in process groups of their own and are
//! stopped by their ids.

use fantoccini::actions::{InputSource, KeyAction, KeyActions};
use fantoccini::{Client, ClientBuilder, Locator};
use reqwest::Method;
use serde_json::{json, Value};
use shoal_testkit::{ApiClient, Process};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const CELLS: u64 = 6;

/// chromedriver on a free loopback port; dropping its process stops its
/// group, chromium with it.
struct Driver {
    _process: Process,
    url: String,
}

impl Driver {
    async fn start(log: &std::path::Path) -> Driver {
        let port = shoal_testkit::free_port();
        let process = Process::spawn(
            std::process::Command::new("chromedriver")
                .arg(format!("--port={port}"))
                .arg("--allowed-ips=127.0.0.1"),
            log,
        );
        let url = format!("http://127.0.0.1:{port}");
        let ready = shoal_testkit::wait_until(Duration::from_secs(20), || {
            let status = format!("{url}/status");
            async move {
                match reqwest::get(&status).await {
                    Ok(r) => r
                        .json::<Value>()
                        .await
                        .is_ok_and(|v| v["value"]["ready"] == true),
                    Err(_) => false,
                }
            }
        })
        .await;
        assert!(ready, "chromedriver did not start: see {}", log.display());
        Driver {
            _process: process,
            url,
        }
    }

    async fn browser(&self, profile: &std::path::Path) -> Client {
        let capabilities = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                // A closed network: Chromium's own background fetches
                // would only fail (NOTES: the machines' browser flags).
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu",
                    "--disable-dev-shm-usage", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--window-size=1280,900",
                    format!("--user-data-dir={}", profile.display()),
                ],
            },
        });
        let Value::Object(capabilities) = capabilities else {
            unreachable!()
        };
        // fantoccini's client is built with rustls, whose provider the
        // process picks once: the product's own choice.
        shoal_fleet::tls::install_crypto_provider();
        ClientBuilder::rustls()
            .expect("a TLS configuration")
            .capabilities(capabilities)
            .connect(&self.url)
            .await
            .expect("a chromium session")
    }
}

/// The page in one browser, with waits that say what they waited for.
struct Page {
    client: Client,
    base: String,
    shots: PathBuf,
}

impl Page {
    async fn open(&self, hash: &str) {
        self.client
            .goto(&format!("{}/{hash}", self.base))
            .await
            .unwrap();
    }

    /// Evaluates `expression` in the page (a JS expression) until it is
    /// truthy; returns its value.
    async fn until(&self, what: &str, expression: &str, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        let script = format!("try {{ return ({expression}); }} catch (e) {{ return null; }}");
        loop {
            let value = self.client.execute(&script, vec![]).await.unwrap();
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return value;
            }
            if Instant::now() > deadline {
                self.shot(&format!("failed-{}", what.replace(' ', "-")))
                    .await;
                let body = self
                    .client
                    .execute("return document.body.innerText", vec![])
                    .await
                    .unwrap();
                panic!(
                    "{what}: `{expression}` still {value} after {limit:?}; the page says: {body}"
                );
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    }

    async fn text(&self, css: &str) -> String {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .text()
            .await
            .unwrap()
    }

    async fn click(&self, css: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    async fn sign_in(&self, token: &str) {
        self.open("#/sandboxes").await;
        self.until(
            "the sign-in form",
            "document.getElementById('signin-token')",
            Duration::from_secs(20),
        )
        .await;
        let field = self
            .client
            .find(Locator::Css("#signin-token"))
            .await
            .unwrap();
        field.clear().await.unwrap();
        field.send_keys(token).await.unwrap();
        self.click("#signin-submit").await;
    }

    async fn sign_out(&self) {
        self.click("#signout").await;
        self.until(
            "signed out",
            "document.body.dataset.page === 'signin'",
            Duration::from_secs(10),
        )
        .await;
    }

    /// Types `text` into whatever has the focus, as key presses.
    async fn type_keys(&self, text: &str) {
        let mut keys = KeyActions::new("keyboard".to_owned());
        for c in text.chars() {
            let value = if c == '\n' { '\u{E007}' } else { c };
            keys = keys
                .then(KeyAction::Down { value })
                .then(KeyAction::Up { value });
        }
        self.client.perform_actions(keys).await.unwrap();
    }

    async fn shot(&self, name: &str) {
        let png = self.client.screenshot().await.unwrap();
        std::fs::create_dir_all(&self.shots).unwrap();
        std::fs::write(self.shots.join(format!("{name}.png")), png).unwrap();
    }
}

fn screenshots_dir() -> PathBuf {
    std::env::var_os("SHOAL_CONSOLE_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| shoal_testkit::workspace_root().join("target/console-screenshots"))
}

#[test]
fn the_console_shows_an_account_its_own_sandboxes_sweeps_and_costs() {
    shoal_testkit::block_on(async {
        let state = shoal_testkit::state_dir("vm_console");
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .start()
            .await;
        let alice_token = up.token("console-alice");
        let bob_token = up.token("console-bob");
        let alice = ApiClient::new(up.base(), &alice_token);
        let driver = Driver::start(&state.join("chromedriver.log")).await;
        let page = Page {
            client: driver.browser(&state.join("chromium-profile")).await,
            base: up.base().to_owned(),
            shots: screenshots_dir(),
        };
        let started = Instant::now();

        // A wrong token: refused, with the server's word, and nothing shown.
        page.sign_in("shoal_not-a-real-token").await;
        let refused = page
            .until(
                "the refusal",
                "document.getElementById('signin-error').textContent",
                Duration::from_secs(10),
            )
            .await;
        assert!(
            refused.as_str().unwrap().to_lowercase().contains("token"),
            "{refused}"
        );
        assert_eq!(
            page.client
                .execute("return document.body.dataset.page", vec![])
                .await
                .unwrap(),
            "signin"
        );
        assert!(page
            .client
            .find(Locator::Css("#sandboxes-table"))
            .await
            .is_err());
        page.shot("signin").await;

        // Signed in: a sandbox made through the API appears in the table.
        page.sign_in(&alice_token).await;
        page.until(
            "alice's account name",
            "document.getElementById('account-name').textContent.includes('console-alice')",
            Duration::from_secs(10),
        )
        .await;
        let sandbox = alice
            .ok(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({
                    "template": "code-interpreter",
                    "metadata": {"project": "console-test"},
                    "ttl_seconds": 600,
                })),
            )
            .await;
        let id = sandbox["id"].as_str().unwrap().to_owned();
        let row = format!("tr[data-sandbox-id='{id}']");
        page.until(
            "the sandbox's row",
            &format!("document.querySelector(\"{row}\")?.dataset.state === 'running'"),
            Duration::from_secs(15),
        )
        .await;
        assert!(page.text(&row).await.contains("project=console-test"));
        page.shot("sandboxes").await;

        // Its page, and a command typed into its terminal.
        page.click(&format!("{row} a[href='#/sandboxes/{id}']"))
            .await;
        page.until(
            "the sandbox page",
            "document.body.dataset.page === 'sandbox' \
             && document.getElementById('sandbox-state').textContent.includes('running')",
            Duration::from_secs(10),
        )
        .await;
        page.click("#terminal-open").await;
        page.until(
            "the terminal's socket",
            "document.getElementById('terminal').dataset.connected === 'true'",
            Duration::from_secs(20),
        )
        .await;
        page.click("#terminal").await;
        page.type_keys("echo console-$((6*7))\n").await;
        page.until(
            "the command's output in the terminal",
            "window.shoalConsole.terminalText().includes('console-42')",
            Duration::from_secs(20),
        )
        .await;
        page.shot("sandbox").await;
        page.click("#terminal-close").await;

        // A sweep submitted through the API: its grid reaches done.
        let sweep = alice
            .ok(
                Method::POST,
                "/v1/sweeps",
                Some(json!({
                    "name": "console-sweep",
                    "template": "code-interpreter",
                    "command": "echo cell-{cell}; sleep 0.$(( {cell} % 5 ))",
                    "cells": {"start": 1, "end": CELLS},
                    "throttle": 3,
                    "timeout_seconds": 60,
                })),
            )
            .await;
        let sweep_id = sweep["id"].as_str().unwrap().to_owned();
        page.open("#/sweeps").await;
        page.until(
            "the sweep's row",
            &format!("document.querySelector(\"tr[data-sweep-id='{sweep_id}']\")"),
            Duration::from_secs(10),
        )
        .await;
        page.shot("sweeps").await;
        page.click(&format!("a[href='#/sweeps/{sweep_id}']")).await;
        page.until(
            "the sweep done, every cell succeeded in the grid",
            &format!(
                "document.getElementById('sweep-state').textContent.includes('done') \
                 && document.querySelectorAll(\"#cell-grid [data-state='succeeded']\").length === {CELLS}"
            ),
            Duration::from_secs(120),
        )
        .await;
        assert!(page.text("#sweep-cost").await.contains('$'));
        page.shot("sweep").await;

        // The cost of it all, in the usage chart and total.
        page.open("#/usage").await;
        let cost = page
            .until(
                "a cost in the usage page",
                "document.body.dataset.page === 'usage' \
                 && Number(document.getElementById('usage-total-cost').dataset.cost)",
                Duration::from_secs(20),
            )
            .await;
        assert!(cost.as_f64().unwrap() > 0.0, "{cost}");
        let field = page
            .client
            .find(Locator::Css("#usage-group-key"))
            .await
            .unwrap();
        field.clear().await.unwrap();
        field.send_keys("project\n").await.unwrap();
        page.until(
            "usage grouped by project",
            "document.getElementById('usage-by-key').textContent.includes('console-test')",
            Duration::from_secs(20),
        )
        .await;
        page.until(
            "the daily chart drawn",
            "document.querySelector('#usage-daily-chart canvas')",
            Duration::from_secs(10),
        )
        .await;
        page.shot("usage").await;

        page.open("#/fleet").await;
        page.until(
            "the host in the fleet table",
            "document.body.dataset.page === 'fleet' \
             && document.querySelectorAll('#fleet-hosts tr[data-host]').length >= 1",
            Duration::from_secs(20),
        )
        .await;
        page.shot("fleet").await;
        // Its history counts the API's create and the sweep's cells.
        let capacity = alice.ok(Method::GET, "/v1/capacity", None).await;
        let placed: u64 = capacity["history"]["placed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert!(placed > CELLS, "{capacity}");

        // Another account sees nothing of alice's, even by address.
        page.sign_out().await;
        page.sign_in(&bob_token).await;
        page.until(
            "bob's empty sandboxes table",
            "document.body.dataset.page === 'sandboxes' \
             && document.getElementById('account-name').textContent.includes('console-bob')",
            Duration::from_secs(10),
        )
        .await;
        let rows = page
            .client
            .find_all(Locator::Css("#sandboxes-table tr[data-sandbox-id]"))
            .await
            .unwrap();
        assert!(rows.is_empty(), "bob sees {} sandboxes", rows.len());
        page.open("#/sweeps").await;
        page.until(
            "bob's sweeps",
            "document.body.dataset.page === 'sweeps'",
            Duration::from_secs(10),
        )
        .await;
        let body: String = page.text("main").await;
        assert!(
            !body.contains("console-sweep"),
            "bob sees alice's sweep: {body}"
        );
        page.open(&format!("#/sandboxes/{id}")).await;
        page.until(
            "alice's sandbox refused to bob",
            "document.getElementById('status')?.textContent.toLowerCase().includes('not found')",
            Duration::from_secs(10),
        )
        .await;
        let body: String = page.text("main").await;
        assert!(
            !body.contains("console-test"),
            "bob sees alice's metadata: {body}"
        );
        page.open("#/usage").await;
        page.until(
            "bob's usage",
            "document.body.dataset.page === 'usage' \
             && document.getElementById('usage-total-cost').dataset.cost !== undefined",
            Duration::from_secs(20),
        )
        .await;
        let bob_cost: f64 = page
            .client
            .execute(
                "return Number(document.getElementById('usage-total-cost').dataset.cost)",
                vec![],
            )
            .await
            .unwrap()
            .as_f64()
            .unwrap();
        assert_eq!(bob_cost, 0.0, "bob is charged alice's usage");
        eprintln!("browser checks took {:?}", started.elapsed());

        page.client.close().await.unwrap();
        let gone = alice
            .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
        assert!(gone.status.is_success(), "{}", gone.text);
        drop(driver);
        drop(up);
    });
}
