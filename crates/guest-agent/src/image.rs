//! What the image says every exec starts with: the `ENV`, `WORKDIR` and
//! `USER` of the Dockerfile a template was built from, which the host's
//! builder writes to [`DEFAULTS_PATH`] before the template is baked, so
//! every sandbox restored from it has them. A request's own environment
//! and directory win over the image's.
//!
//! Read at each exec (a few hundred bytes; a stat and a read), so a file
//! written by a build takes effect at once and nothing is cached across a
//! snapshot. A missing file means no defaults; an unreadable or malformed
//! one fails the exec with the reason rather than running it as someone
//! else or somewhere else.
//!
//! Does not own: starting the process (see `exec`).

use crate::errors::CallError;
use crate::exec::{ExecSpec, Ids};
use serde_json::Value;
use shoal_proto::ErrorKind;

/// Where the builder leaves the image's exec defaults.
pub const DEFAULTS_PATH: &str = "/etc/shoal/exec.json";
/// The largest defaults file read.
const MAX_DEFAULTS_BYTES: u64 = 256 * 1024;

fn broken(why: impl std::fmt::Display) -> CallError {
    CallError::new(
        ErrorKind::InvalidInput,
        format!("the image's exec defaults ({DEFAULTS_PATH}): {why}"),
    )
}

/// Fills in what `spec` leaves to the image.
pub fn apply(spec: &mut ExecSpec) -> Result<(), CallError> {
    apply_from(spec, std::path::Path::new(DEFAULTS_PATH), "/etc/passwd")
}

fn apply_from(spec: &mut ExecSpec, path: &std::path::Path, passwd: &str) -> Result<(), CallError> {
    let text = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(broken(e)),
        Ok(meta) if meta.len() > MAX_DEFAULTS_BYTES => {
            return Err(broken(format!("over {MAX_DEFAULTS_BYTES} bytes")))
        }
        Ok(_) => std::fs::read_to_string(path).map_err(broken)?,
    };
    let value: Value = serde_json::from_str(&text).map_err(broken)?;
    if let Some(env) = value.get("env").and_then(Value::as_object) {
        for (key, v) in env {
            let Some(v) = v.as_str() else {
                return Err(broken(format!("env {key} is not a string")));
            };
            spec.env.entry(key.clone()).or_insert_with(|| v.to_owned());
        }
    }
    if spec.cwd.is_none() {
        if let Some(cwd) = value.get("cwd").and_then(Value::as_str) {
            spec.cwd = Some(cwd.to_owned());
        }
    }
    if let Some(user) = value.get("user").and_then(Value::as_str) {
        let account = resolve(user, passwd)?;
        if account.ids.uid != 0 {
            spec.ids = Some(account.ids);
        }
        for (key, v) in [
            ("HOME", account.home),
            ("USER", account.name.clone()),
            ("LOGNAME", account.name),
        ] {
            if let Some(v) = v {
                spec.env.entry(key.into()).or_insert(v);
            }
        }
    }
    Ok(())
}

struct Account {
    ids: Ids,
    name: Option<String>,
    home: Option<String>,
}

/// `name`, `uid`, `name:group` or `uid:gid`, as Docker's `USER` takes it.
fn resolve(user: &str, passwd_path: &str) -> Result<Account, CallError> {
    let passwd = std::fs::read_to_string(passwd_path).unwrap_or_default();
    let entries: Vec<Vec<&str>> = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(|f| f.len() >= 7)
        .collect();
    let (who, group) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let entry = entries
        .iter()
        .find(|f| f[0] == who || (who.parse::<u32>().is_ok() && f[2] == who));
    let uid = match (who.parse::<u32>(), entry) {
        (Ok(uid), _) => uid,
        (Err(_), Some(f)) => f[2]
            .parse()
            .map_err(|_| broken(format!("bad uid for {who}")))?,
        (Err(_), None) => return Err(broken(format!("no user {who} in /etc/passwd"))),
    };
    let gid = match group {
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => group_id(g).ok_or_else(|| broken(format!("no group {g} in /etc/group")))?,
        },
        None => match entry {
            Some(f) => f[3]
                .parse()
                .map_err(|_| broken(format!("bad gid for {who}")))?,
            None => uid,
        },
    };
    Ok(Account {
        ids: Ids { uid, gid },
        name: entry.map(|f| f[0].to_owned()),
        home: entry.map(|f| f[5].to_owned()),
    })
}

fn group_id(name: &str) -> Option<u32> {
    let groups = std::fs::read_to_string("/etc/group").ok()?;
    groups.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 3 && f[0] == name)
            .then(|| f[2].parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("shoal-image-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn the_image_fills_in_what_the_request_leaves_out() {
        let dir = scratch("fill");
        let passwd = write(
            &dir,
            "passwd",
            "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1001::/home/alice:/bin/sh\n",
        );
        let defaults = write(
            &dir,
            "exec.json",
            r#"{"env":{"A":"image","B":"image"},"cwd":"/srv","user":"alice"}"#,
        );
        let mut spec = ExecSpec::default();
        spec.env.insert("A".into(), "request".into());
        apply_from(&mut spec, &defaults, passwd.to_str().unwrap()).unwrap();
        assert_eq!(spec.env["A"], "request");
        assert_eq!(spec.env["B"], "image");
        assert_eq!(spec.env["HOME"], "/home/alice");
        assert_eq!(spec.cwd.as_deref(), Some("/srv"));
        assert_eq!(
            spec.ids,
            Some(Ids {
                uid: 1000,
                gid: 1001
            })
        );

        let mut spec = ExecSpec {
            cwd: Some("/tmp".into()),
            ..ExecSpec::default()
        };
        apply_from(
            &mut spec,
            &dir.join("absent.json"),
            passwd.to_str().unwrap(),
        )
        .unwrap();
        assert_eq!(
            (spec.cwd.as_deref(), spec.ids, spec.env.len()),
            (Some("/tmp"), None, 0)
        );
    }

    #[test]
    fn numeric_users_and_bad_files() {
        let dir = scratch("bad");
        let passwd = write(&dir, "passwd", "root:x:0:0:root:/root:/bin/sh\n");
        let numeric = write(&dir, "n.json", r#"{"user":"4242:4343"}"#);
        let mut spec = ExecSpec::default();
        apply_from(&mut spec, &numeric, passwd.to_str().unwrap()).unwrap();
        assert_eq!(
            spec.ids,
            Some(Ids {
                uid: 4242,
                gid: 4343
            })
        );
        let root = write(&dir, "r.json", r#"{"user":"root"}"#);
        let mut spec = ExecSpec::default();
        apply_from(&mut spec, &root, passwd.to_str().unwrap()).unwrap();
        assert_eq!(spec.ids, None);
        for bad in [
            r#"{"user":"nobody-here"}"#,
            "not json",
            r#"{"env":{"A":1}}"#,
        ] {
            let path = write(&dir, "bad.json", bad);
            let err =
                apply_from(&mut ExecSpec::default(), &path, passwd.to_str().unwrap()).unwrap_err();
            assert!(err.message.contains(DEFAULTS_PATH), "{}", err.message);
        }
    }
}
