//! Dockerfiles as a template build reads them (issue 21): parsed into the
//! steps a builder VM runs (`RUN`, `COPY`/`ADD` from the build context,
//! `ENV`, `WORKDIR`, `USER`) and the template's settings (its base, its
//! environment, working directory and user, its start command and
//! readiness check), with every refusal naming its line.
//!
//! This module only reads text: it runs nothing and opens no file. What it
//! accepts is what real single-stage Dockerfiles use; what it refuses
//! (another stage, `ONBUILD`, `VOLUME`, `RUN --mount`, heredocs, remote
//! `ADD` sources, an image that is neither a Shoal template nor Debian) it
//! refuses with the reason and what to do instead.
//!
//! Variables: `ARG` (with its default; a build passes no arguments yet) and
//! `ENV` are substituted as Docker does (`$X`, `${X}`, `${X:-word}`,
//! `${X:+word}`) in `FROM` (global `ARG`s only), `COPY`, `ADD`, `ENV`,
//! `WORKDIR` and `USER`; a `RUN` line is left to its shell, which gets them
//! in its environment.

use std::collections::BTreeMap;

/// Largest Dockerfile read, in bytes.
pub const MAX_DOCKERFILE_BYTES: usize = 1 << 20;

/// A refusal, at a line of the Dockerfile (1-based; 0 for the file as a whole).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", if *.line > 0 { format!("Dockerfile line {}: ", .line) } else { String::new() })]
pub struct DockerfileError {
    pub line: usize,
    pub message: String,
}

fn refuse<T>(line: usize, message: impl Into<String>) -> Result<T, DockerfileError> {
    Err(DockerfileError {
        line,
        message: message.into(),
    })
}

/// What the build starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Base {
    /// A Shoal template by name (`FROM base`, `FROM code-interpreter`, or an
    /// account's own).
    Template(String),
    /// A Debian release Shoal bootstraps itself (`FROM debian:bookworm`,
    /// `debian:12-slim`): the release's code name.
    Debian(String),
}

/// One step the builder VM runs, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Where it is in the Dockerfile (its first line).
    pub line: usize,
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A command, as argv (a shell form line is `[shell..., line]`), run
    /// with the environment, directory and user in force.
    Run {
        argv: Vec<String>,
        /// The `ARG`s in force (not kept in the template, unlike `ENV`).
        args: BTreeMap<String, String>,
    },
    /// Files of the build context (relative paths, `*` and `?` allowed in
    /// the last component) to `dest` (absolute; a directory when it ends in
    /// `/` or there are several sources). `ADD` also unpacks a local tar
    /// archive, as Docker does.
    Copy {
        sources: Vec<String>,
        dest: String,
        chown: Option<String>,
        chmod: Option<String>,
        unpack_archives: bool,
    },
    /// From here on, these are in the environment (and the template's).
    Env { vars: Vec<(String, String)> },
    /// From here on, commands run in this directory (absolute).
    Workdir { path: String },
    /// From here on, commands run as this user (`name`, `uid`, `user:group`).
    User { user: String },
}

/// A parsed Dockerfile: what to build from, the steps, and what the
/// template keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    pub base: Base,
    pub steps: Vec<Step>,
    /// The environment every sandbox of the template starts with (`ENV`).
    pub env: BTreeMap<String, String>,
    /// The working directory of execs (`WORKDIR`; `/` if none).
    pub workdir: String,
    /// The user of execs (`USER`; root if none).
    pub user: Option<String>,
    /// The process the bake starts and every sandbox has running
    /// (`ENTRYPOINT` and `CMD`, combined as Docker combines them).
    pub start: Option<Vec<String>>,
    /// The command the bake waits to succeed before it snapshots
    /// (`HEALTHCHECK CMD`).
    pub ready: Option<Vec<String>>,
    /// Ports the image says it listens on (`EXPOSE`), for information.
    pub ports: Vec<u16>,
    /// `LABEL`s, for information.
    pub labels: BTreeMap<String, String>,
}

/// One instruction after line continuations are joined.
struct Instruction {
    line: usize,
    keyword: String,
    rest: String,
}

/// Parses `text`; the first refusal ends it.
pub fn parse(text: &str) -> Result<Dockerfile, DockerfileError> {
    if text.len() > MAX_DOCKERFILE_BYTES {
        return refuse(
            0,
            format!("the Dockerfile is over {} bytes", MAX_DOCKERFILE_BYTES),
        );
    }
    let instructions = instructions(text)?;
    let mut builder = Builder::default();
    for instruction in instructions {
        builder.take(instruction)?;
    }
    builder.finish()
}

/// Splits the text into instructions: comments and blank lines dropped,
/// `\` continuations joined, parser directives checked.
fn instructions(text: &str) -> Result<Vec<Instruction>, DockerfileError> {
    let mut out = Vec::new();
    let mut pending: Option<Instruction> = None;
    let mut directives_allowed = true;
    for (index, raw) in text.lines().enumerate() {
        let line_no = index + 1;
        let trimmed = raw.trim();
        if let Some(comment) = trimmed.strip_prefix('#') {
            if directives_allowed && pending.is_none() {
                if let Some((key, value)) = comment.split_once('=') {
                    let (key, value) = (key.trim().to_ascii_lowercase(), value.trim());
                    match key.as_str() {
                        "syntax" | "check" => continue,
                        "escape" if value == "\\" => continue,
                        "escape" => {
                            return refuse(
                                line_no,
                                "only the default escape character (\\) is supported",
                            )
                        }
                        _ => {}
                    }
                }
            }
            directives_allowed = false;
            continue;
        }
        if trimmed.is_empty() {
            directives_allowed = false;
            continue;
        }
        directives_allowed = false;
        let (body, continues) = match trimmed.strip_suffix('\\') {
            Some(body) => (body, true),
            None => (trimmed, false),
        };
        match &mut pending {
            Some(instruction) => {
                instruction.rest.push(' ');
                instruction.rest.push_str(body.trim());
            }
            None => {
                let (keyword, rest) = match body.split_once(char::is_whitespace) {
                    Some((keyword, rest)) => (keyword, rest.trim()),
                    None => (body, ""),
                };
                pending = Some(Instruction {
                    line: line_no,
                    keyword: keyword.to_ascii_uppercase(),
                    rest: rest.to_owned(),
                });
            }
        }
        if !continues {
            out.extend(pending.take());
        }
    }
    if let Some(unfinished) = pending {
        return refuse(
            unfinished.line,
            "the instruction's last line ends in a continuation (\\)",
        );
    }
    Ok(out)
}

#[derive(Default)]
struct Builder {
    base: Option<Base>,
    /// `ARG`s before `FROM`: usable in `FROM` only, as in Docker (unless
    /// declared again after it).
    global_args: BTreeMap<String, String>,
    /// `ARG`s and `ENV`s in force for substitution after `FROM`.
    vars: BTreeMap<String, String>,
    steps: Vec<Step>,
    env: BTreeMap<String, String>,
    workdir: String,
    user: Option<String>,
    shell: Vec<String>,
    cmd: Option<(Vec<String>, bool)>,
    entrypoint: Option<(Vec<String>, bool)>,
    ready: Option<Vec<String>>,
    ports: Vec<u16>,
    labels: BTreeMap<String, String>,
}

impl Builder {
    fn take(&mut self, i: Instruction) -> Result<(), DockerfileError> {
        let line = i.line;
        if self.base.is_none() && !matches!(i.keyword.as_str(), "FROM" | "ARG") {
            return refuse(
                line,
                format!(
                    "{} before FROM: a Dockerfile starts with FROM (after ARGs)",
                    i.keyword
                ),
            );
        }
        match i.keyword.as_str() {
            "FROM" => self.from(line, &i.rest),
            "ARG" => self.arg(line, &i.rest),
            "RUN" => {
                let argv = self.command(line, "RUN", &i.rest)?.0;
                let args = self
                    .vars
                    .iter()
                    .filter(|(name, _)| !self.env.contains_key(*name))
                    .map(|(name, value)| (name.clone(), value.clone()))
                    .collect();
                self.steps.push(Step {
                    line,
                    action: Action::Run { argv, args },
                });
                Ok(())
            }
            "COPY" => self.copy(line, &i.rest, false),
            "ADD" => self.copy(line, &i.rest, true),
            "ENV" => {
                let vars = key_values(line, "ENV", &i.rest, &self.vars)?;
                for (key, value) in &vars {
                    self.env.insert(key.clone(), value.clone());
                    self.vars.insert(key.clone(), value.clone());
                }
                self.steps.push(Step {
                    line,
                    action: Action::Env { vars },
                });
                Ok(())
            }
            "WORKDIR" => {
                let path = self.expand(line, i.rest.trim())?;
                if path.is_empty() {
                    return refuse(line, "WORKDIR needs a path");
                }
                let path = if path.starts_with('/') {
                    path
                } else {
                    format!("{}/{}", self.workdir.trim_end_matches('/'), path)
                };
                self.workdir = normalize(&path);
                self.steps.push(Step {
                    line,
                    action: Action::Workdir {
                        path: self.workdir.clone(),
                    },
                });
                Ok(())
            }
            "USER" => {
                let user = self.expand(line, i.rest.trim())?;
                if user.is_empty() || user.contains(char::is_whitespace) {
                    return refuse(line, "USER takes one user, as name, uid or user:group");
                }
                self.user = Some(user.clone());
                self.steps.push(Step {
                    line,
                    action: Action::User { user },
                });
                Ok(())
            }
            "CMD" => {
                self.cmd = Some(self.command(line, "CMD", &i.rest)?);
                Ok(())
            }
            "ENTRYPOINT" => {
                self.entrypoint = Some(self.command(line, "ENTRYPOINT", &i.rest)?);
                Ok(())
            }
            "SHELL" => match json_argv(&i.rest) {
                Some(Ok(shell)) if !shell.is_empty() => {
                    self.shell = shell;
                    Ok(())
                }
                _ => refuse(
                    line,
                    "SHELL takes a JSON array, e.g. SHELL [\"/bin/bash\", \"-c\"]",
                ),
            },
            "HEALTHCHECK" => self.healthcheck(line, &i.rest),
            "EXPOSE" => {
                for word in i.rest.split_whitespace() {
                    let word = self.expand(line, word)?;
                    let port = word.split('/').next().unwrap_or_default();
                    match port.parse::<u16>() {
                        Ok(port) if port > 0 => self.ports.push(port),
                        _ => return refuse(line, format!("EXPOSE: not a port: {word:?}")),
                    }
                }
                Ok(())
            }
            "LABEL" => {
                for (key, value) in key_values(line, "LABEL", &i.rest, &self.vars)? {
                    self.labels.insert(key, value);
                }
                Ok(())
            }
            "MAINTAINER" | "STOPSIGNAL" => Ok(()),
            "VOLUME" => refuse(
                line,
                "VOLUME is not supported: attach a Shoal volume when you create a sandbox",
            ),
            "ONBUILD" => refuse(line, "ONBUILD is not supported"),
            other => refuse(line, format!("unknown instruction {other}")),
        }
    }

    fn from(&mut self, line: usize, rest: &str) -> Result<(), DockerfileError> {
        if self.base.is_some() {
            return refuse(
                line,
                "a second FROM: multi-stage builds are not supported (one FROM per Dockerfile)",
            );
        }
        let mut words: Vec<&str> = rest.split_whitespace().collect();
        if let Some(flag) = words.first().filter(|w| w.starts_with("--")) {
            match flag.strip_prefix("--platform=") {
                Some("linux/amd64") | Some("linux/x86_64") => {
                    words.remove(0);
                }
                _ => return refuse(line, format!("FROM {flag}: templates are linux/amd64")),
            }
        }
        let image = match words.as_slice() {
            [image] | [image, _, _] if words.len() != 3 || words[1].eq_ignore_ascii_case("as") => {
                image
            }
            _ => return refuse(line, "FROM takes an image and an optional `AS name`"),
        };
        let scope = self.global_args.clone();
        let image = substitute(line, image, &scope)?;
        self.base = Some(base_of(line, &image)?);
        self.workdir = "/".into();
        self.shell = vec!["/bin/sh".into(), "-c".into()];
        Ok(())
    }

    fn arg(&mut self, line: usize, rest: &str) -> Result<(), DockerfileError> {
        let rest = rest.trim();
        if rest.is_empty() {
            return refuse(line, "ARG needs a name");
        }
        for word in split_words(line, rest, None)? {
            let (name, default) = match word.split_once('=') {
                Some((name, default)) => (name.to_owned(), Some(default.to_owned())),
                None => (word.clone(), None),
            };
            if !valid_name(&name) {
                return refuse(line, format!("ARG: not a variable name: {name:?}"));
            }
            if self.base.is_none() {
                self.global_args.insert(name, default.unwrap_or_default());
            } else {
                // Declared again after FROM, a global ARG keeps its value.
                let value = match default {
                    Some(default) => self.expand(line, &default)?,
                    None => self.global_args.get(&name).cloned().unwrap_or_default(),
                };
                self.vars.entry(name).or_insert(value);
            }
        }
        Ok(())
    }

    fn copy(&mut self, line: usize, rest: &str, add: bool) -> Result<(), DockerfileError> {
        let what = if add { "ADD" } else { "COPY" };
        let mut rest = rest.trim();
        let (mut chown, mut chmod) = (None, None);
        while let Some(flagged) = rest.strip_prefix("--") {
            let (flag, after) = flagged
                .split_once(char::is_whitespace)
                .unwrap_or((flagged, ""));
            match flag.split_once('=') {
                Some(("chown", value)) => chown = Some(self.expand(line, value)?),
                Some(("chmod", value))
                    if value.len() <= 4 && value.chars().all(|c| ('0'..='7').contains(&c)) =>
                {
                    chmod = Some(value.to_owned())
                }
                Some(("from", _)) => {
                    return refuse(
                        line,
                        format!("{what} --from: multi-stage builds are not supported"),
                    )
                }
                Some(("link", _)) | None if flag == "link" => {}
                _ => return refuse(line, format!("{what} --{flag} is not supported")),
            }
            rest = after.trim_start();
        }
        let mut words = match json_argv(rest) {
            Some(Ok(words)) => words
                .iter()
                .map(|w| self.expand(line, w))
                .collect::<Result<Vec<_>, _>>()?,
            Some(Err(e)) => return refuse(line, format!("{what}: {e}")),
            None => split_words(line, rest, Some(&self.vars))?,
        };
        if words.len() < 2 {
            return refuse(
                line,
                format!("{what} needs at least one source and a destination"),
            );
        }
        let dest = words.pop().unwrap_or_default();
        for source in &words {
            if source.contains("://") || source.starts_with("git@") {
                return refuse(
                    line,
                    format!("{what} {source}: remote sources are not supported; RUN curl or git clone instead"),
                );
            }
            if context_path(source).is_none() {
                return refuse(
                    line,
                    format!("{what} {source}: the source is outside the build context"),
                );
            }
        }
        let sources = words
            .iter()
            .map(|s| context_path(s).unwrap_or_default())
            .collect();
        let absolute = if dest.starts_with('/') {
            dest.clone()
        } else {
            format!("{}/{}", self.workdir.trim_end_matches('/'), dest)
        };
        let mut dest_path = normalize(&absolute);
        if dest.ends_with('/') && !dest_path.ends_with('/') {
            dest_path.push('/');
        }
        self.steps.push(Step {
            line,
            action: Action::Copy {
                sources,
                dest: dest_path,
                chown,
                chmod,
                unpack_archives: add,
            },
        });
        Ok(())
    }

    fn healthcheck(&mut self, line: usize, rest: &str) -> Result<(), DockerfileError> {
        let mut rest = rest.trim();
        if rest.eq_ignore_ascii_case("none") {
            self.ready = None;
            return Ok(());
        }
        // Interval, timeout and retries are the bake's own: it waits up to
        // its deadline, trying again every few hundred milliseconds.
        while let Some(flagged) = rest.strip_prefix("--") {
            let (flag, after) = flagged
                .split_once(char::is_whitespace)
                .unwrap_or((flagged, ""));
            let name = flag.split('=').next().unwrap_or_default();
            if !matches!(
                name,
                "interval" | "timeout" | "start-period" | "start-interval" | "retries"
            ) {
                return refuse(line, format!("HEALTHCHECK --{name} is not supported"));
            }
            rest = after.trim_start();
        }
        let Some(command) = rest
            .get(..3)
            .filter(|w| w.eq_ignore_ascii_case("cmd"))
            .map(|_| &rest[3..])
            .filter(|r| r.is_empty() || r.starts_with(char::is_whitespace))
        else {
            return refuse(line, "HEALTHCHECK takes CMD command (or NONE)");
        };
        self.ready = Some(self.command(line, "HEALTHCHECK CMD", command)?.0);
        Ok(())
    }

    /// A command in exec form (a JSON array) or shell form (run by the
    /// `SHELL`); true when it was shell form.
    fn command(
        &self,
        line: usize,
        what: &str,
        rest: &str,
    ) -> Result<(Vec<String>, bool), DockerfileError> {
        let rest = rest.trim();
        if rest.starts_with("--") {
            let flag = rest.split_whitespace().next().unwrap_or_default();
            return refuse(line, format!("{what} {flag} is not supported"));
        }
        if rest.contains("<<")
            && rest
                .split_whitespace()
                .any(|w| w.starts_with("<<") && w.len() > 2 && !w.starts_with("<<<"))
            && what == "RUN"
        {
            return refuse(
                line,
                "RUN with a heredoc is not supported: write the file with COPY, then RUN it",
            );
        }
        if rest.is_empty() {
            return refuse(line, format!("{what} needs a command"));
        }
        match json_argv(rest) {
            Some(Ok(argv)) if !argv.is_empty() => Ok((argv, false)),
            Some(Ok(_)) => refuse(line, format!("{what} needs a command")),
            // Not valid JSON: Docker runs it as a shell command too.
            Some(Err(_)) | None => {
                let mut argv = self.shell.clone();
                argv.push(rest.to_owned());
                Ok((argv, true))
            }
        }
    }

    fn expand(&self, line: usize, word: &str) -> Result<String, DockerfileError> {
        substitute(line, word, &self.vars)
    }

    fn finish(self) -> Result<Dockerfile, DockerfileError> {
        let Some(base) = self.base else {
            return refuse(
                0,
                "no FROM: a Dockerfile starts with FROM (a Shoal template or debian:<release>)",
            );
        };
        // Docker: an exec-form ENTRYPOINT takes CMD as its arguments; a
        // shell-form one ignores CMD.
        let start = match (self.entrypoint, self.cmd) {
            (Some((entry, false)), Some((cmd, _))) => Some([entry, cmd].concat()),
            (Some((entry, _)), _) => Some(entry),
            (None, Some((cmd, _))) => Some(cmd),
            (None, None) => None,
        };
        Ok(Dockerfile {
            base,
            steps: self.steps,
            env: self.env,
            workdir: self.workdir,
            user: self.user,
            start,
            ready: self.ready,
            ports: self.ports,
            labels: self.labels,
        })
    }
}

/// The base an image reference names.
fn base_of(line: usize, image: &str) -> Result<Base, DockerfileError> {
    let (name, tag) = match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name, Some(tag)),
        _ => (image, None),
    };
    let name = name
        .strip_prefix("docker.io/")
        .unwrap_or(name)
        .strip_prefix("library/")
        .unwrap_or(name);
    if name == "debian" {
        // As Docker Hub's tags name them on 2026-12-05: stable is 13.
        let tag = tag.unwrap_or("latest");
        let release = tag.split('-').next().unwrap_or(tag);
        let code = match release {
            "12" | "bookworm" | "oldstable" => "bookworm",
            "11" | "bullseye" | "oldoldstable" => "bullseye",
            "13" | "trixie" | "stable" | "latest" => "trixie",
            _ => {
                return refuse(
                    line,
                    format!("FROM {image}: unknown Debian release (bookworm, bullseye or trixie)"),
                )
            }
        };
        return Ok(Base::Debian(code.into()));
    }
    if name == "scratch" {
        return refuse(
            line,
            "FROM scratch: use a root filesystem tarball (templates build with rootfs_tar) instead",
        );
    }
    if tag.is_none() && !name.contains('/') && crate::templates::valid_template_name(name) {
        return Ok(Base::Template(name.into()));
    }
    refuse(
        line,
        format!("FROM {image}: a template builds from a Shoal template (base, code-interpreter, or one of yours) or debian:<release>; for another image, register its OCI archive"),
    )
}

/// `KEY=value ...` (values may be quoted), or the legacy `KEY value with
/// spaces` of a single pair; variables substituted from `vars`.
fn key_values(
    line: usize,
    what: &str,
    rest: &str,
    vars: &BTreeMap<String, String>,
) -> Result<Vec<(String, String)>, DockerfileError> {
    let rest = rest.trim();
    let first = rest.split_whitespace().next().unwrap_or_default();
    if !first.contains('=') {
        let (key, value) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        if !valid_name(key) || value.trim().is_empty() {
            return refuse(line, format!("{what} takes KEY=value pairs"));
        }
        return Ok(vec![(
            key.to_owned(),
            substitute(line, value.trim(), vars)?,
        )]);
    }
    let mut pairs = Vec::new();
    // Split before substituting: a value's variables may hold spaces.
    for word in split_words(line, rest, None)? {
        let Some((key, _)) = word.split_once('=') else {
            return refuse(line, format!("{what}: {word:?} is not KEY=value"));
        };
        if what == "ENV" && !valid_name(key) {
            return refuse(line, format!("{what}: not a variable name: {key:?}"));
        }
    }
    for word in split_words(line, rest, Some(vars))? {
        let (key, value) = word.split_once('=').unwrap_or((&word, ""));
        pairs.push((key.to_owned(), value.to_owned()));
    }
    Ok(pairs)
}

/// Words split on whitespace, with `"..."` and `'...'` quoting and `\`
/// escapes; the quotes are removed. With `vars`, variables are substituted
/// outside single quotes, as Docker does.
fn split_words(
    line: usize,
    text: &str,
    vars: Option<&BTreeMap<String, String>>,
) -> Result<Vec<String>, DockerfileError> {
    let mut words = Vec::new();
    let mut word = String::new();
    // What is yet to be substituted (outside single quotes).
    let mut open = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let flush = |word: &mut String, open: &mut String| -> Result<(), DockerfileError> {
        match vars {
            Some(vars) => word.push_str(&substitute(line, open, vars)?),
            None => word.push_str(&open.replace("\\$", "$")),
        }
        open.clear();
        Ok(())
    };
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if in_word {
                    flush(&mut word, &mut open)?;
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, '"') => {
                quote = Some('"');
                in_word = true;
            }
            (None, '\'') => {
                flush(&mut word, &mut open)?;
                quote = Some('\'');
                in_word = true;
            }
            (Some(q), c) if c == q => quote = None,
            (Some('\''), c) => word.push(c),
            (_, '\\') => {
                in_word = true;
                match chars.next() {
                    Some('$') => open.push_str("\\$"),
                    Some(next) => open.push(next),
                    None => open.push('\\'),
                }
            }
            (_, c) => {
                open.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return refuse(line, "an unterminated quote");
    }
    if in_word {
        flush(&mut word, &mut open)?;
        words.push(word);
    }
    Ok(words)
}

/// `Some` when `text` is meant as a JSON array (it starts with `[`): its
/// strings, or why it is not an array of strings.
fn json_argv(text: &str) -> Option<Result<Vec<String>, String>> {
    let text = text.trim();
    if !text.starts_with('[') {
        return None;
    }
    Some(
        serde_json::from_str::<Vec<String>>(text)
            .map_err(|e| format!("not a JSON array of strings: {e}")),
    )
}

/// Docker's variable substitution in `word` from `vars`; an unset variable
/// is empty.
fn substitute(
    line: usize,
    word: &str,
    vars: &BTreeMap<String, String>,
) -> Result<String, DockerfileError> {
    let mut out = String::new();
    let mut chars = word.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'$') => {
                out.push('$');
                chars.next();
            }
            '$' if chars.peek() == Some(&'{') => {
                chars.next();
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) => inner.push(c),
                        None => return refuse(line, format!("an unterminated ${{ in {word:?}")),
                    }
                }
                let (name, modifier) = match inner.find(':') {
                    Some(at) => (&inner[..at], Some(&inner[at..])),
                    None => (inner.as_str(), None),
                };
                if !valid_name(name) {
                    return refuse(line, format!("not a variable name: ${{{inner}}}"));
                }
                let value = vars.get(name).filter(|v| !v.is_empty());
                match modifier {
                    None => out.push_str(vars.get(name).map_or("", String::as_str)),
                    Some(m) if m.starts_with(":-") => match value {
                        Some(v) => out.push_str(v),
                        None => out.push_str(&substitute(line, &m[2..], vars)?),
                    },
                    Some(m) if m.starts_with(":+") => {
                        if value.is_some() {
                            out.push_str(&substitute(line, &m[2..], vars)?);
                        }
                    }
                    Some(m) => {
                        return refuse(line, format!("unsupported substitution ${{{name}{m}}}"))
                    }
                }
            }
            '$' if chars
                .peek()
                .is_some_and(|c| c.is_ascii_alphabetic() || *c == '_') =>
            {
                let mut name = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        name.push(c);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push_str(vars.get(&name).map_or("", String::as_str));
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A source inside the build context, as a relative path without `.`
/// components; `None` when it would leave the context.
fn context_path(source: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for part in source.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            part => parts.push(part),
        }
    }
    Some(if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    })
}

/// An absolute path with `.` and `..` resolved (never above `/`).
fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    format!("/{}", parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(text: &str) -> DockerfileError {
        parse(text).expect_err("refused")
    }

    #[test]
    fn a_typical_dockerfile_becomes_steps_and_settings() {
        let parsed = parse(
            "# syntax=docker/dockerfile:1\n\
             ARG PY=python3\n\
             FROM code-interpreter AS build\n\
             ARG PY\n\
             ARG PKG=numpy\n\
             ENV APP_HOME=/srv/app MODE=\"fast mode\"\n\
             WORKDIR $APP_HOME\n\
             COPY --chown=1000:1000 requirements.txt ./\n\
             RUN ${PY} -m pip install -r requirements.txt \\\n    \
                 && echo done\n\
             ADD data.tar.gz /data/\n\
             USER 1000\n\
             EXPOSE 8000/tcp\n\
             LABEL org.example.team=\"ml\"\n\
             HEALTHCHECK --interval=5s CMD curl -f http://localhost:8000/\n\
             ENTRYPOINT [\"python3\", \"-m\", \"http.server\"]\n\
             CMD [\"8000\"]\n",
        )
        .unwrap();
        assert_eq!(parsed.base, Base::Template("code-interpreter".into()));
        assert_eq!(parsed.workdir, "/srv/app");
        assert_eq!(parsed.user.as_deref(), Some("1000"));
        assert_eq!(parsed.env["MODE"], "fast mode");
        assert_eq!(parsed.ports, [8000]);
        assert_eq!(parsed.labels["org.example.team"], "ml");
        assert_eq!(
            parsed.start,
            Some(vec![
                "python3".into(),
                "-m".into(),
                "http.server".into(),
                "8000".into()
            ])
        );
        assert_eq!(
            parsed.ready,
            Some(vec![
                "/bin/sh".into(),
                "-c".into(),
                "curl -f http://localhost:8000/".into()
            ])
        );
        let actions: Vec<&Action> = parsed.steps.iter().map(|s| &s.action).collect();
        assert_eq!(
            actions[2],
            &Action::Copy {
                sources: vec!["requirements.txt".into()],
                dest: "/srv/app/".into(),
                chown: Some("1000:1000".into()),
                chmod: None,
                unpack_archives: false,
            }
        );
        // RUN keeps its variables for the shell; continuation lines join.
        assert_eq!(
            actions[3],
            &Action::Run {
                argv: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "${PY} -m pip install -r requirements.txt && echo done".into()
                ],
                args: [("PKG", "numpy"), ("PY", "python3")]
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .into(),
            }
        );
        assert_eq!(parsed.steps[3].line, 9);
        assert!(
            matches!(actions[4], Action::Copy { unpack_archives: true, dest, .. } if dest == "/data/")
        );
    }

    #[test]
    fn debian_releases_and_templates_are_bases_and_other_images_are_refused() {
        let base = |from: &str| parse(&format!("FROM {from}\n")).map(|d| d.base);
        assert_eq!(
            base("debian:bookworm-slim"),
            Ok(Base::Debian("bookworm".into()))
        );
        assert_eq!(base("debian:12"), Ok(Base::Debian("bookworm".into())));
        assert_eq!(base("debian"), Ok(Base::Debian("trixie".into())));
        assert_eq!(
            base("debian:stable-slim"),
            Ok(Base::Debian("trixie".into()))
        );
        assert_eq!(
            base("docker.io/library/debian:bullseye"),
            Ok(Base::Debian("bullseye".into()))
        );
        assert_eq!(base("base"), Ok(Base::Template("base".into())));
        assert_eq!(
            base("--platform=linux/amd64 base"),
            Ok(Base::Template("base".into()))
        );
        for other in [
            "python:3.11",
            "ubuntu:22.04",
            "ghcr.io/x/y",
            "scratch",
            "debian:sid",
        ] {
            let e = base(other).unwrap_err();
            assert_eq!(e.line, 1, "{other}");
            assert!(e.message.contains("FROM"), "{other}: {e}");
        }
        assert!(base("--platform=linux/arm64 base").is_err());
    }

    #[test]
    fn a_global_arg_reaches_from() {
        let parsed = parse("ARG BASE=base\nFROM ${BASE}\n").unwrap();
        assert_eq!(parsed.base, Base::Template("base".into()));
        let parsed = parse("ARG REL\nFROM debian:${REL:-bookworm}\n").unwrap();
        assert_eq!(parsed.base, Base::Debian("bookworm".into()));
    }

    #[test]
    fn refusals_name_their_line() {
        let cases = [
            ("FROM base\nFROB x\n", 2, "unknown instruction FROB"),
            ("FROM base\nFROM base\n", 2, "multi-stage"),
            ("FROM base\nCOPY --from=build /a /b\n", 2, "multi-stage"),
            (
                "FROM base\n\nCOPY ../secret /x\n",
                3,
                "outside the build context",
            ),
            (
                "FROM base\nADD https://example.com/x.tgz /x\n",
                2,
                "remote sources",
            ),
            ("FROM base\nRUN <<EOF\n", 2, "heredoc"),
            (
                "FROM base\nRUN --mount=type=cache,target=/root/.cache pip install x\n",
                2,
                "--mount",
            ),
            ("FROM base\nVOLUME /data\n", 2, "VOLUME"),
            ("FROM base\nONBUILD RUN x\n", 2, "ONBUILD"),
            ("RUN echo hi\n", 1, "before FROM"),
            ("FROM base\nCOPY onlyone\n", 2, "a destination"),
            ("FROM base\nENV\n", 2, "KEY=value"),
            ("FROM base\nENV A=\"open\n", 2, "unterminated"),
            ("FROM base\nRUN echo \\\n", 2, "continuation"),
            ("FROM base\nEXPOSE http\n", 2, "not a port"),
            ("# escape=`\nFROM base\n", 1, "escape"),
            ("FROM base\nRUN\n", 2, "needs a command"),
            (
                "FROM base\nWORKDIR ${X:?must}\n",
                2,
                "unsupported substitution",
            ),
        ];
        for (text, line, says) in cases {
            let e = refusal(text);
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.to_string().contains(says), "{text:?}: {e}");
            assert!(
                e.to_string()
                    .starts_with(&format!("Dockerfile line {line}: ")),
                "{e}"
            );
        }
        assert!(refusal("# only a comment\n").message.contains("no FROM"));
        assert!(refusal(&"#".repeat(MAX_DOCKERFILE_BYTES + 1))
            .message
            .contains("bytes"));
    }

    #[test]
    fn env_forms_substitution_and_workdir_resolution() {
        let parsed = parse(
            "FROM base\n\
             ENV LEGACY value with spaces\n\
             ENV A=1 B=${A}2\n\
             ENV C=\"${B} 3\" D='$A' E=\\$A\n\
             WORKDIR /opt\n\
             WORKDIR app/../src\n\
             ARG VER\n\
             ENV V=${VER:-default} W=${A:+set}\n",
        )
        .unwrap();
        assert_eq!(parsed.env["LEGACY"], "value with spaces");
        // As in Docker, a pair sees the values from before its instruction.
        assert_eq!(parsed.env["B"], "2");
        assert_eq!(parsed.env["C"], "2 3");
        assert_eq!(parsed.env["D"], "$A");
        assert_eq!(parsed.env["V"], "default");
        assert_eq!(parsed.env["W"], "set");
        assert_eq!(parsed.workdir, "/opt/src");
        assert_eq!(parsed.steps.len(), 6);
        assert_eq!(parsed.env["E"], "$A");
    }

    #[test]
    fn start_commands_combine_as_docker_combines_them() {
        let start = |text: &str| parse(&format!("FROM base\n{text}")).unwrap().start;
        assert_eq!(start(""), None);
        assert_eq!(
            start("CMD python3 app.py\n"),
            Some(vec!["/bin/sh".into(), "-c".into(), "python3 app.py".into()])
        );
        assert_eq!(
            start("ENTRYPOINT exec server\nCMD [\"ignored\"]\n"),
            Some(vec!["/bin/sh".into(), "-c".into(), "exec server".into()])
        );
        assert_eq!(
            start("SHELL [\"/bin/bash\", \"-lc\"]\nCMD jupyter lab\n"),
            Some(vec!["/bin/bash".into(), "-lc".into(), "jupyter lab".into()])
        );
        // Malformed JSON is a shell command, as in Docker.
        assert_eq!(
            start("CMD [not json\n"),
            Some(vec!["/bin/sh".into(), "-c".into(), "[not json".into()])
        );
    }

    #[test]
    fn copy_json_form_globs_and_context_paths() {
        let parsed =
            parse("FROM base\nWORKDIR /w\nCOPY [\"a b.txt\", \"./src/*.py\", \"dest\"]\n").unwrap();
        assert_eq!(
            parsed.steps[1].action,
            Action::Copy {
                sources: vec!["a b.txt".into(), "src/*.py".into()],
                dest: "/w/dest".into(),
                chown: None,
                chmod: None,
                unpack_archives: false,
            }
        );
        assert_eq!(context_path("a/../b"), Some("b".into()));
        assert_eq!(context_path("."), Some(".".into()));
        assert_eq!(context_path("a/../../b"), None);
        assert_eq!(normalize("/a/../../b/./c"), "/b/c");
    }
}
