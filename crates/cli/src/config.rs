//! Where each setting comes from. Every flag of every command can also be
//! set by an environment variable, `SHOAL_` and its long name in capitals
//! (`--state-dir` is `SHOAL_STATE_DIR`) unless the flag names one of its
//! own (`--token` reads `PANDASTACK_API_KEY`), and by a key of the
//! configuration file: `--config FILE`, else `SHOAL_CONFIG`, else
//! [`DEFAULT_CONFIG`] when it exists. A key is the flag's long name, at the
//! top of the file (for every command that has the flag) or in the table of
//! one command (`[up]`, `[agent]`, `[template.build]`), which wins. A flag
//! beats the environment, the environment beats the file, the file beats
//! the built-in default; `shoal config show` prints each value with where
//! it came from.
//!
//! The file also holds what no flag sets: the tiers' limits
//! (`[tiers.free] concurrent = 5`, `creates_per_hour = 60`) and the rate
//! card (`[rates] cpu_hour_usd`, `gib_hour_usd`). A key the file has that
//! no command reads is an error, so a typo is not silently ignored.
//!
//! Owns: reading the file and wiring it and the environment into clap's
//! command tree. May not: act on any setting (the commands do).

use anyhow::{bail, Context, Result};
use shoal_store::{RateCard, Tier, TierLimits};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The configuration file read when neither `--config` nor `SHOAL_CONFIG`
/// names one (and only if it exists).
pub const DEFAULT_CONFIG: &str = "/etc/shoal/shoal.toml";

/// Tables of the file that are not commands.
const SETTINGS_TABLES: [&str; 2] = ["tiers", "rates"];

/// Flags that are not settings: clap's own and `--config` itself.
const NOT_SETTINGS: [&str; 3] = ["help", "version", "config"];

/// The configuration file, parsed (empty when there is none).
#[derive(Debug, Default)]
pub struct ConfigFile {
    pub path: Option<PathBuf>,
    table: toml::Table,
}

impl ConfigFile {
    /// The file `args` (the whole command line) or the environment name, or
    /// the default one if it exists.
    pub fn locate(args: &[OsString]) -> Result<ConfigFile> {
        let named = named_on_command_line(args)
            .or_else(|| std::env::var_os("SHOAL_CONFIG").map(PathBuf::from));
        let path = match named {
            Some(path) => path,
            None if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
            None => return Ok(ConfigFile::default()),
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading the configuration {}", path.display()))?;
        ConfigFile::parse(&text, Some(path))
    }

    pub fn parse(text: &str, path: Option<PathBuf>) -> Result<ConfigFile> {
        let table: toml::Table = text.parse().with_context(|| {
            format!(
                "parsing the configuration {}",
                path.as_deref().unwrap_or(Path::new("")).display()
            )
        })?;
        Ok(ConfigFile { path, table })
    }

    fn shown_path(&self) -> String {
        self.path
            .as_deref()
            .map_or_else(|| "the configuration".into(), |p| p.display().to_string())
    }

    /// The value of flag `long` for the command at `path` (`["template",
    /// "build"]`): from that command's table, else from the top.
    fn value(&self, path: &[String], long: &str) -> Option<(String, &toml::Value)> {
        let mut table = &self.table;
        let mut tables = vec![(String::new(), table)];
        for (depth, name) in path.iter().enumerate() {
            match table.get(name) {
                Some(toml::Value::Table(inner)) => {
                    table = inner;
                    tables.push((path[..=depth].join("."), table));
                }
                _ => break,
            }
        }
        tables.into_iter().rev().find_map(|(prefix, table)| {
            let value = table
                .get(long)
                .or_else(|| table.get(&long.replace('-', "_")))?;
            if value.is_table() {
                return None;
            }
            let key = if prefix.is_empty() {
                long.to_string()
            } else {
                format!("{prefix}.{long}")
            };
            Some((key, value))
        })
    }

    /// The tiers' limits the file sets, over the built-in ones.
    pub fn tier_limits(&self) -> Result<HashMap<Tier, TierLimits>> {
        let mut limits: HashMap<Tier, TierLimits> = [Tier::Free, Tier::Pro, Tier::Team]
            .into_iter()
            .map(|t| (t, TierLimits::default_for(t)))
            .collect();
        let Some(tiers) = self.table.get("tiers") else {
            return Ok(limits);
        };
        let tiers = tiers
            .as_table()
            .with_context(|| format!("{}: tiers must be a table", self.shown_path()))?;
        for (name, settings) in tiers {
            let tier: Tier = name.parse().map_err(|_| {
                anyhow::anyhow!("{}: no tier {name} (free, pro, team)", self.shown_path())
            })?;
            let settings = settings
                .as_table()
                .with_context(|| format!("{}: tiers.{name} must be a table", self.shown_path()))?;
            let entry = limits.get_mut(&tier).expect("every tier has limits");
            for (key, value) in settings {
                let number = value
                    .as_integer()
                    .and_then(|n| u32::try_from(n).ok())
                    .with_context(|| {
                        format!(
                            "{}: tiers.{name}.{key} must be a whole number",
                            self.shown_path()
                        )
                    })?;
                match key.as_str() {
                    "concurrent" => entry.concurrent = number,
                    "creates_per_hour" => entry.creates_per_hour = number,
                    _ => bail!(
                        "{}: tiers.{name}.{key} is not a setting (concurrent, creates_per_hour)",
                        self.shown_path()
                    ),
                }
            }
        }
        Ok(limits)
    }

    /// The rate card the file sets, over the built-in one.
    pub fn rate_card(&self) -> Result<RateCard> {
        let mut card = RateCard::default();
        let Some(rates) = self.table.get("rates") else {
            return Ok(card);
        };
        let rates = rates
            .as_table()
            .with_context(|| format!("{}: rates must be a table", self.shown_path()))?;
        for (key, value) in rates {
            let price = value
                .as_float()
                .or_else(|| value.as_integer().map(|n| n as f64))
                .filter(|p| p.is_finite() && *p >= 0.0)
                .with_context(|| {
                    format!("{}: rates.{key} must be a number ≥ 0", self.shown_path())
                })?;
            match key.as_str() {
                "cpu_hour_usd" => card.cpu_hour_usd = price,
                "gib_hour_usd" => card.gib_hour_usd = price,
                _ => bail!(
                    "{}: rates.{key} is not a setting (cpu_hour_usd, gib_hour_usd)",
                    self.shown_path()
                ),
            }
        }
        Ok(card)
    }

    /// Every key of the file that is a setting, as `up.listen`, `listen`,
    /// `tiers` (whose contents [`ConfigFile::tier_limits`] checks).
    fn keys(&self) -> BTreeSet<String> {
        fn walk(table: &toml::Table, prefix: &str, out: &mut BTreeSet<String>) {
            for (key, value) in table {
                let key = key.replace('_', "-");
                let full = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                match value {
                    toml::Value::Table(inner)
                        if !(prefix.is_empty() && SETTINGS_TABLES.contains(&key.as_str())) =>
                    {
                        walk(inner, &full, out)
                    }
                    _ => {
                        out.insert(full);
                    }
                }
            }
        }
        let mut keys = BTreeSet::new();
        walk(&self.table, "", &mut keys);
        keys
    }
}

fn named_on_command_line(args: &[OsString]) -> Option<PathBuf> {
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let arg = arg.to_string_lossy();
        if arg == "--" {
            return None;
        }
        if arg == "--config" {
            return args.next().map(PathBuf::from);
        }
        if let Some(path) = arg.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    None
}

static FILE: std::sync::OnceLock<ConfigFile> = std::sync::OnceLock::new();

/// Keeps the file the command line was read with, for what no flag sets
/// (tiers, rates).
pub fn set_file(file: ConfigFile) {
    let _ = FILE.set(file);
}

/// The file the command line was read with (empty before, or without one).
pub fn file() -> &'static ConfigFile {
    FILE.get_or_init(ConfigFile::default)
}

/// Which settings the file gave, by command path and flag id.
#[derive(Debug, Default)]
pub struct FromFile {
    path: String,
    given: BTreeSet<(String, String)>,
}

/// The environment variable of flag `long` when it names none of its own.
pub fn env_name(long: &str) -> String {
    format!("SHOAL_{}", long.replace('-', "_").to_uppercase())
}

pub(crate) fn leak(text: String) -> &'static str {
    // Each command's tree is built once per process; its strings live as
    // long as the process.
    Box::leak(text.into_boxed_str())
}

fn toml_text(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(n) => Some(n.to_string()),
        toml::Value::Float(x) => Some(x.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// `command` with every flag given its environment variable and the file's
/// value as its default; fails on a key of the file that no command reads
/// or a value of the wrong kind.
pub fn wire(command: clap::Command, file: &ConfigFile) -> Result<(clap::Command, FromFile)> {
    let mut from_file = FromFile {
        path: file.shown_path(),
        ..FromFile::default()
    };
    let mut used = BTreeSet::new();
    let command = wire_one(command, &[], file, &mut from_file, &mut used)?;
    let unknown: Vec<String> = file
        .keys()
        .into_iter()
        .filter(|k| !used.contains(k))
        .filter(|k| !SETTINGS_TABLES.contains(&k.as_str()))
        .collect();
    if !unknown.is_empty() {
        bail!(
            "{}: no command reads {} (keys are flags' long names, at the top or in a command's table)",
            file.shown_path(),
            unknown.join(", ")
        );
    }
    file.tier_limits()?;
    file.rate_card()?;
    Ok((command, from_file))
}

fn wire_one(
    mut command: clap::Command,
    path: &[String],
    file: &ConfigFile,
    from_file: &mut FromFile,
    used: &mut BTreeSet<String>,
) -> Result<clap::Command> {
    let flags: Vec<(String, String)> = command
        .get_arguments()
        .filter_map(|a| Some((a.get_id().to_string(), a.get_long()?.to_string())))
        .filter(|(_, long)| !NOT_SETTINGS.contains(&long.as_str()))
        .collect();
    for (id, long) in flags {
        let found = file.value(path, &long);
        if let Some((key, _)) = &found {
            used.insert(key.replace('_', "-"));
        }
        let defaults: Option<Vec<&'static str>> = match &found {
            None => None,
            Some((key, toml::Value::Array(items))) => Some(
                items
                    .iter()
                    .map(|v| toml_text(v).map(leak))
                    .collect::<Option<Vec<_>>>()
                    .with_context(|| {
                        format!("{}: {key} must hold plain values", file.shown_path())
                    })?,
            ),
            Some((key, value)) => Some(vec![leak(toml_text(value).with_context(|| {
                format!("{}: {key} must be a plain value", file.shown_path())
            })?)]),
        };
        if defaults.is_some() {
            from_file.given.insert((path.join(" "), id.clone()));
        }
        command = command.mut_arg(&id, |arg| {
            let arg = if arg.get_env().is_none() {
                arg.env(leak(env_name(&long)))
            } else {
                arg
            };
            match defaults {
                Some(values) => arg.default_values(values).required(false),
                None => arg,
            }
        });
    }
    let names: Vec<String> = command
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    for name in names {
        let mut inner_path = path.to_vec();
        inner_path.push(name.clone());
        let mut failure = None;
        command = command.mut_subcommand(&name, |sub| {
            match wire_one(sub.clone(), &inner_path, file, from_file, used) {
                Ok(wired) => wired,
                Err(e) => {
                    failure = Some(e);
                    sub
                }
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
    }
    Ok(command)
}

/// `shoal config show [COMMAND...]`: every setting of that command (`up`
/// by default) as the command would see it now, with its source.
pub fn show(command: &clap::Command, from_file: &FromFile, path: &[String]) -> Result<String> {
    let path: Vec<String> = if path.is_empty() {
        vec!["up".into()]
    } else {
        path.to_vec()
    };
    let mut argv = vec!["shoal".to_string()];
    argv.extend(path.iter().cloned());
    let matches = command
        .clone()
        .try_get_matches_from(&argv)
        .map_err(|e| anyhow::anyhow!("{}", e.render()))?;
    let mut sub_matches = &matches;
    let mut sub_command = command;
    for name in &path {
        sub_matches = sub_matches
            .subcommand_matches(name)
            .with_context(|| format!("no command {name}"))?;
        sub_command = sub_command
            .find_subcommand(name)
            .with_context(|| format!("no command {name}"))?;
    }
    let mut rows: BTreeMap<String, (String, String)> = BTreeMap::new();
    for arg in sub_command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if NOT_SETTINGS.contains(&long) {
            continue;
        }
        let id = arg.get_id().as_str();
        let value = sub_matches
            .get_raw(id)
            .map(|values| {
                values
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let env = arg
            .get_env()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_default();
        let source = match sub_matches.value_source(id) {
            Some(clap::parser::ValueSource::CommandLine) => "flag".to_string(),
            Some(clap::parser::ValueSource::EnvVariable) => format!("environment {env}"),
            Some(clap::parser::ValueSource::DefaultValue)
                if from_file.given.contains(&(path.join(" "), id.to_string())) =>
            {
                format!("file {}", from_file.path)
            }
            Some(clap::parser::ValueSource::DefaultValue) => "default".to_string(),
            _ => "unset".to_string(),
        };
        rows.insert(long.to_string(), (value, format!("{source} (env {env})")));
    }
    let mut out = format!("# shoal {}\n", path.join(" "));
    for (long, (value, source)) in rows {
        out.push_str(&format!("{long} = {value:?}  # {source}\n"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    fn wired(text: &str) -> Result<(clap::Command, FromFile)> {
        let file = ConfigFile::parse(text, Some(PathBuf::from("/test/shoal.toml")))?;
        wire(crate::Cli::command(), &file)
    }

    fn walk(command: &clap::Command, path: &str, out: &mut Vec<(String, String, Option<String>)>) {
        for arg in command.get_arguments() {
            if let Some(long) = arg.get_long() {
                if !NOT_SETTINGS.contains(&long) {
                    out.push((
                        path.to_string(),
                        long.to_string(),
                        arg.get_env().map(|e| e.to_string_lossy().into_owned()),
                    ));
                }
            }
        }
        for sub in command.get_subcommands() {
            walk(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn every_flag_of_every_command_has_an_environment_variable() {
        let (command, _) = wired("").unwrap();
        let mut flags = Vec::new();
        walk(&command, "shoal", &mut flags);
        assert!(flags.len() > 100, "the walk found {} flags", flags.len());
        for (path, long, env) in &flags {
            let env = env
                .as_deref()
                .unwrap_or_else(|| panic!("{path} --{long} has no environment variable"));
            assert!(
                env.starts_with("SHOAL_") || env.starts_with("PANDASTACK_"),
                "{path} --{long}: {env}"
            );
        }
        let up_listen = flags
            .iter()
            .find(|(p, l, _)| p == "shoal up" && l == "listen")
            .unwrap();
        assert_eq!(up_listen.2.as_deref(), Some("SHOAL_LISTEN"));
        command.debug_assert();
    }

    #[test]
    fn a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default() {
        let (command, from_file) = wired(
            "listen = \"0.0.0.0:9000\"\n[up]\nmax-sandboxes = 7\nregistry = [\"a.example\", \"b.example\"]\n",
        )
        .unwrap();
        let shown = show(&command, &from_file, &[]).unwrap();
        assert!(
            shown.contains("listen = \"0.0.0.0:9000\"  # file /test/shoal.toml (env SHOAL_LISTEN)"),
            "{shown}"
        );
        assert!(shown.contains("max-sandboxes = \"7\"  # file"), "{shown}");
        assert!(
            shown.contains("registry = \"a.example,b.example\"  # file"),
            "{shown}"
        );
        assert!(
            shown.contains("memory-reserve-mib = \"")
                && shown.contains("# default (env SHOAL_MEMORY_RESERVE_MIB)"),
            "{shown}"
        );
        let matches = command
            .clone()
            .try_get_matches_from(["shoal", "up", "--listen", "127.0.0.1:1"])
            .unwrap();
        let up = matches.subcommand_matches("up").unwrap();
        assert_eq!(up.get_one::<String>("listen").unwrap(), "127.0.0.1:1");
        assert_eq!(
            up.value_source("listen"),
            Some(clap::parser::ValueSource::CommandLine)
        );
        // The file's top-level key reaches every command with that flag,
        // and a command's table wins over the top.
        let (command, _) =
            wired("listen = \"0.0.0.0:9000\"\n[server]\nlisten = \"0.0.0.0:9100\"\n").unwrap();
        let default_of = |name: &str| {
            let arg = command
                .find_subcommand(name)
                .unwrap()
                .get_arguments()
                .find(|a| a.get_long() == Some("listen"))
                .unwrap();
            arg.get_default_values()[0].to_string_lossy().into_owned()
        };
        assert_eq!(default_of("up"), "0.0.0.0:9000");
        assert_eq!(default_of("server"), "0.0.0.0:9100");
    }

    #[test]
    fn the_environment_is_read() {
        // A variable no other test sets: the flag's own. Clap reads it
        // when the flag is given its name, so before the wiring.
        std::env::set_var("SHOAL_REAP_INTERVAL", "9");
        let wired = wired("[up]\nreap-interval = 5\n");
        std::env::remove_var("SHOAL_REAP_INTERVAL");
        let (command, from_file) = wired.unwrap();
        let shown = show(&command, &from_file, &["up".into()]);
        let shown = shown.unwrap();
        assert!(
            shown.contains("reap-interval = \"9\"  # environment SHOAL_REAP_INTERVAL"),
            "{shown}"
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        for (text, words) in [
            ("lisen = \"x\"", "no command reads lisen"),
            ("[up]\nnope = 1", "no command reads up.nope"),
            ("[tiers.gold]\nconcurrent = 1", "no tier gold"),
            ("[tiers.free]\nconcurrent = -1", "whole number"),
            ("[tiers.free]\nparallel = 1", "not a setting"),
            ("[rates]\ncpu_hour_usd = \"cheap\"", "number"),
            ("[up]\nlisten = { a = 1 }", "no command reads up.listen.a"),
            ("listen = [[1]]", "plain values"),
            ("not toml", "parsing"),
        ] {
            let error = format!(
                "{:#}",
                wired(text)
                    .err()
                    .unwrap_or_else(|| panic!("{text} was taken"))
            );
            assert!(error.contains(words), "{text}: {error}");
        }
    }

    #[test]
    fn tiers_and_rates_come_from_the_file() {
        let file = ConfigFile::parse(
            "[tiers.free]\nconcurrent = 1\n[tiers.team]\ncreates_per_hour = 7\n[rates]\ncpu_hour_usd = 1\ngib_hour_usd = 0.5\n",
            None,
        )
        .unwrap();
        let limits = file.tier_limits().unwrap();
        assert_eq!(limits[&Tier::Free].concurrent, 1);
        assert_eq!(
            limits[&Tier::Free].creates_per_hour,
            TierLimits::default_for(Tier::Free).creates_per_hour
        );
        assert_eq!(limits[&Tier::Team].creates_per_hour, 7);
        assert_eq!(limits[&Tier::Pro], TierLimits::default_for(Tier::Pro));
        let card = file.rate_card().unwrap();
        assert_eq!((card.cpu_hour_usd, card.gib_hour_usd), (1.0, 0.5));
    }

    #[test]
    fn the_file_is_named_by_flag_or_environment() {
        let args: Vec<OsString> = ["shoal", "up", "--config", "/x.toml"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(named_on_command_line(&args), Some(PathBuf::from("/x.toml")));
        let args: Vec<OsString> = ["shoal", "--config=/y.toml", "up"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(named_on_command_line(&args), Some(PathBuf::from("/y.toml")));
        let args: Vec<OsString> = ["shoal", "run", "--", "--config", "z"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(named_on_command_line(&args), None);
    }
}
