//! `--export`: which of the submitting shell's variables a task gets
//! (sbatch(1), "--export"). `ALL` (Slurm's default) is every variable,
//! `NONE` none, and a list names variables (`NAME` takes the submitting
//! shell's value, `NAME=value` sets one), with `ALL` in the list adding the
//! rest.
//!
//! Where Shoal differs: a task runs in a sandbox, not on a node that shares
//! the submitting machine's accounts and file systems, so `ALL` leaves out
//! what describes that machine's session and would mislead the guest
//! ([`is_machine_variable`]: `PATH`, `HOME`, the locale, terminal, SSH and
//! desktop variables) and Shoal's and PandaStack's own credentials. Naming
//! one of them exports it all the same.
//!
//! May not: read the environment itself; the caller passes it in.

use std::collections::BTreeMap;

use crate::SlurmError;

/// Variables of the submitting machine's session that `ALL` leaves out.
pub fn is_machine_variable(name: &str) -> bool {
    const NAMES: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "TERM",
        "TERMCAP",
        "COLORTERM",
        "DISPLAY",
        "HOSTNAME",
        "MAIL",
        "TMPDIR",
        "TMP",
        "TEMP",
        "_",
        "LS_COLORS",
        "LANG",
        "LANGUAGE",
        "EDITOR",
        "VISUAL",
        "PAGER",
        "MANPATH",
        "INFOPATH",
        "PS1",
        "PS2",
        "PROMPT_COMMAND",
        "HISTFILE",
        "HISTSIZE",
        "HISTFILESIZE",
        "HISTCONTROL",
        "OSTYPE",
        "HOSTTYPE",
        "MACHTYPE",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
    ];
    const PREFIXES: &[&str] = &[
        "LC_",
        "SSH_",
        "XDG_",
        "DBUS_",
        "SLURM_",
        "SBATCH_",
        "SHOAL_",
        "PANDASTACK_",
        "GPG_",
        "WAYLAND_",
        "KRB5",
        "BASH_FUNC_",
    ];
    NAMES.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}

fn valid_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The variables a task gets under `spec` (`None`: Slurm's default,
/// `ALL`) from the submitting shell's `environment`.
pub fn exported_environment(
    spec: Option<&str>,
    environment: impl IntoIterator<Item = (String, String)>,
) -> Result<BTreeMap<String, String>, SlurmError> {
    let environment: BTreeMap<String, String> = environment.into_iter().collect();
    let all = || {
        environment
            .iter()
            .filter(|(name, _)| valid_name(name) && !is_machine_variable(name))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<BTreeMap<_, _>>()
    };
    let spec = spec.unwrap_or("ALL").trim();
    match spec {
        "ALL" => return Ok(all()),
        "NONE" | "NIL" => return Ok(BTreeMap::new()),
        _ => {}
    }
    let invalid = |reason: String| SlurmError::InvalidExport {
        value: spec.to_owned(),
        reason,
    };
    let mut exported = BTreeMap::new();
    let mut named = BTreeMap::new();
    for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item {
            "ALL" => exported = all(),
            "NONE" | "NIL" => {
                return Err(invalid(format!(
                    "{item} cannot be combined with other items"
                )))
            }
            _ => {
                let (name, value) = match item.split_once('=') {
                    Some((name, value)) => (name, Some(value.to_owned())),
                    None => (item, None),
                };
                if !valid_name(name) {
                    return Err(invalid(format!("{name:?} is not a variable name")));
                }
                // A named variable the shell does not have is left unset, as
                // Slurm leaves it.
                if let Some(value) = value.or_else(|| environment.get(name).cloned()) {
                    named.insert(name.to_owned(), value);
                }
            }
        }
    }
    exported.extend(named);
    Ok(exported)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell() -> Vec<(String, String)> {
        [
            ("MY_PARAM", "42"),
            ("OMP_NUM_THREADS", "4"),
            ("PATH", "/home/u/miniconda/bin:/usr/bin"),
            ("HOME", "/home/u"),
            ("LC_ALL", "en_US.UTF-8"),
            ("SHOAL_TOKEN", "secret"),
            ("SLURM_JOB_ID", "7"),
            ("weird-name", "x"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    fn names(map: &BTreeMap<String, String>) -> Vec<&str> {
        map.keys().map(String::as_str).collect()
    }

    #[test]
    fn all_is_the_shell_without_the_machine_and_credentials() {
        let all = exported_environment(None, shell()).unwrap();
        assert_eq!(names(&all), ["MY_PARAM", "OMP_NUM_THREADS"]);
        assert_eq!(all["MY_PARAM"], "42");
        assert_eq!(exported_environment(Some("ALL"), shell()).unwrap(), all);
    }

    #[test]
    fn none_and_lists_export_what_they_name() {
        assert!(exported_environment(Some("NONE"), shell())
            .unwrap()
            .is_empty());
        let listed = exported_environment(Some("MY_PARAM,EXTRA=a=b,UNSET_ONE"), shell()).unwrap();
        assert_eq!(names(&listed), ["EXTRA", "MY_PARAM"]);
        assert_eq!(listed["EXTRA"], "a=b");
        // ALL in a list adds the rest; a named machine variable goes too.
        let both = exported_environment(Some("ALL,PATH,MY_PARAM=override"), shell()).unwrap();
        assert_eq!(names(&both), ["MY_PARAM", "OMP_NUM_THREADS", "PATH"]);
        assert_eq!(both["MY_PARAM"], "override");
    }

    #[test]
    fn bad_lists_are_refused_with_the_reason() {
        for (spec, why) in [
            ("ALL,NONE", "cannot be combined"),
            ("1BAD=x", "not a variable name"),
        ] {
            let e = exported_environment(Some(spec), shell())
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{spec}: {e}");
        }
    }
}
