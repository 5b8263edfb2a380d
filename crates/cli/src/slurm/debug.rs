//! `shoal debug JOBID_TASK [-- CMD...]`: into the sandbox a failed task
//! left behind (`--keep-failed`), with its files and processes as the task
//! ended. With a command it runs it there and exits with its code; without
//! one it opens an interactive shell over the sandbox's WebSocket terminal
//! (`/v1/sandboxes/{id}/exec/pty`, PandaStack's protocol).
//!
//! Owns: finding the kept sandbox of a task, the terminal's raw mode and
//! the bridge between this terminal and the socket. May not: keep or
//! delete sandboxes (the runner and the reaper do).

use anyhow::{bail, Context as _, Result};
use futures::{SinkExt as _, StreamExt as _};
use std::os::fd::AsRawFd as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::Message;

use super::api::Api;
use super::config::Config;
use super::views::resolve;

/// The kept sandbox of task `target` (`ID_TASK`, or a task's own id), and
/// the job's working directory.
async fn kept_sandbox(api: &Api, target: &str) -> Result<(String, Option<String>)> {
    let job = shoal_slurm::parse_job_ref(target)?;
    let Some((sweep, index)) = resolve(api, job.job_id).await? else {
        bail!("Invalid job id specified: {target}");
    };
    let id = sweep["id"].as_str().unwrap_or("").to_owned();
    let cells = api.cells(&id).await?;
    let cell = cells
        .iter()
        .find(|c| match (index, job.task_id) {
            (Some(i), _) => c["index"].as_u64() == Some(i),
            (None, Some(t)) => c["value"].as_str() == Some(&t.to_string()),
            (None, None) => cells.len() == 1,
        })
        .with_context(|| format!("{target}: name one task (JOBID_TASK)"))?;
    let state = cell["state"].as_str().unwrap_or("");
    let kept = cell["error"]
        .as_str()
        .is_some_and(|e| e.contains("kept, hibernated"));
    match (state, kept, cell["sandbox_id"].as_str()) {
        ("failed" | "timeout", true, Some(sandbox)) => Ok((
            sandbox.to_owned(),
            sweep["slurm"]["work_dir"].as_str().map(str::to_owned),
        )),
        ("running", _, _) => bail!("task {target} is still running"),
        _ => bail!(
            "task {target} ({state}) has no kept sandbox: submit with --keep-failed (or #SHOAL \
             --keep-failed=2h) to keep a failed task's sandbox for shoal debug"
        ),
    }
}

/// Puts the terminal in raw mode until dropped.
struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    fn enter() -> Option<RawMode> {
        let fd = std::io::stdin().as_raw_fd();
        // SAFETY: termios is plain data; tcgetattr fills it or fails.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd is stdin; saved is a valid termios.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: raw is a valid termios copied from the terminal's.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: fd is stdin; raw is a valid termios.
        (unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } == 0).then_some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `enter` on the same fd.
        unsafe { libc::tcsetattr(std::io::stdin().as_raw_fd(), libc::TCSANOW, &self.saved) };
    }
}

fn terminal_size() -> (u16, u16) {
    // SAFETY: winsize is plain data; TIOCGWINSZ fills it or fails.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: stdout's fd and a valid winsize.
    let ok =
        unsafe { libc::ioctl(std::io::stdout().as_raw_fd(), libc::TIOCGWINSZ, &mut size) } == 0;
    if ok && size.ws_row > 0 && size.ws_col > 0 {
        (size.ws_row, size.ws_col)
    } else {
        (24, 80)
    }
}

/// The rustls settings for a `wss://` API: the configured CA alone, else
/// the web's roots.
fn tls_connector(config: &Config) -> Result<Option<tokio_tungstenite::Connector>> {
    let Some(ca) = config.ca_file.as_deref() else {
        return Ok(None);
    };
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("reading {}", ca.display()))?
    {
        roots
            .add(cert.with_context(|| format!("reading {}", ca.display()))?)
            .with_context(|| format!("{}: not a CA certificate", ca.display()))?;
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Some(tokio_tungstenite::Connector::Rustls(
        std::sync::Arc::new(tls),
    )))
}

/// An interactive shell in `sandbox` (in `cwd`) until it exits; its exit
/// code.
async fn terminal(config: &Config, sandbox: &str, cwd: Option<&str>) -> Result<i32> {
    let (rows, cols) = terminal_size();
    let base = config.base_url()?;
    let ws_base = if let Some(rest) = base.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if let Some(rest) = base.strip_prefix("http://") {
        format!("ws://{rest}")
    } else {
        bail!("the API address {base} is not http:// or https://");
    };
    let mut url = format!("{ws_base}/v1/sandboxes/{sandbox}/exec/pty?rows={rows}&cols={cols}");
    if let Some(dir) = cwd {
        url.push_str("&cwd=");
        url.push_str(&url::form_urlencoded::byte_serialize(dir.as_bytes()).collect::<String>());
    }
    let mut request = url.into_client_request()?;
    request.headers_mut().insert(
        "authorization",
        format!("Bearer {}", config.token()?).parse()?,
    );
    let (socket, _) = tokio_tungstenite::connect_async_tls_with_config(
        request,
        None,
        false,
        tls_connector(config)?,
    )
    .await
    .context("opening the sandbox's terminal")?;
    let (mut to_server, mut from_server) = socket.split();
    let raw = RawMode::enter();
    let mut stdin = tokio::io::stdin();
    let mut stdout = tokio::io::stdout();
    let mut buf = vec![0u8; 4096];
    let mut code = 0;
    loop {
        tokio::select! {
            read = stdin.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => to_server.send(Message::Binary(buf[..n].to_vec().into())).await?,
            },
            message = from_server.next() => match message {
                Some(Ok(Message::Binary(bytes))) => {
                    stdout.write_all(&bytes).await?;
                    stdout.flush().await?;
                }
                Some(Ok(Message::Text(text))) => {
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    if let Some(c) = v["exit"].as_i64() {
                        code = c as i32;
                    } else if let Some(e) = v["error"].as_str() {
                        drop(raw);
                        bail!("the terminal ended: {e}");
                    }
                }
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    drop(raw);
                    return Err(e).context("the terminal's connection");
                }
            },
        }
    }
    drop(raw);
    Ok(code)
}

/// `shoal shell ID`: an interactive shell in a running sandbox (Slurm's
/// `salloc` + `srun --pty bash`: a persistent sandbox with a terminal
/// attached); its exit code.
pub async fn shell(sandbox: &str) -> Result<i32> {
    terminal(&Config::load()?, sandbox, None).await
}

/// `shoal debug`: runs `command` in the task's kept sandbox (printing its
/// output), or opens a shell there; returns the exit code.
pub async fn debug(target: &str, command: &[String]) -> Result<i32> {
    let config = Config::load()?;
    let api = Api::new(&config)?;
    let (sandbox, work_dir) = kept_sandbox(&api, target).await?;
    if command.is_empty() {
        return terminal(&config, &sandbox, work_dir.as_deref()).await;
    }
    // In the task's working directory, as the task was.
    let answer = api
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{sandbox}/exec"),
            Some(&serde_json::json!({
                "cmd": command.join(" "),
                "cwd": work_dir,
                "timeout_seconds": 600,
            })),
        )
        .await?;
    print!("{}", answer["stdout"].as_str().unwrap_or(""));
    eprint!("{}", answer["stderr"].as_str().unwrap_or(""));
    Ok(answer["exit_code"].as_i64().unwrap_or(1) as i32)
}
