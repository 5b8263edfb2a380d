//! Warm-start arrays (issue 22): a job's prelude runs once, in a sandbox
//! that every array task then forks from, so a model load or a data read
//! happens once per job instead of once per task.
//!
//! The prelude is either a block of the script between `#SHOAL --prelude`
//! and `#SHOAL --end-prelude` lines (on a Slurm cluster those lines run in
//! every task, as the shell sees them) or a file named with `--prelude
//! FILE` / `#SHOAL --prelude=FILE`. What it leaves on disk and in running
//! processes, each task has; its shell variables it does not.
//!
//! Owns: finding the prelude and taking the block out of the per-task
//! script. May not: run anything (the runner's `fork_from` does).

use anyhow::{bail, Context as _, Result};

/// Where the prelude is written in the job's first sandbox.
pub const PRELUDE_PATH: &str = "/tmp/shoal-slurm/prelude.sh";

/// A job's prelude and the script its tasks run.
#[derive(Debug, PartialEq, Eq)]
pub struct Split {
    /// The script without the block (each of its lines left as an empty
    /// comment, so line numbers in errors stay the user's).
    pub task_body: String,
    /// The prelude's text, if the job has one.
    pub prelude: Option<String>,
}

fn directive(line: &str) -> Option<&str> {
    line.trim().strip_prefix("#SHOAL").map(str::trim)
}

/// Splits `body` (the script as tasks would run it) and applies `file`
/// (`--prelude FILE`, read by the caller) or `#SHOAL --prelude=FILE`
/// (read from `base`, the submit directory).
pub fn split(body: &str, file: Option<String>, base: &std::path::Path) -> Result<Split> {
    let mut task = Vec::new();
    let mut block: Option<Vec<&str>> = None;
    let mut prelude = file;
    let mut finished_block = false;
    for (n, line) in body.lines().enumerate() {
        match directive(line) {
            Some("--prelude") => {
                if block.is_some() || finished_block {
                    bail!("line {}: a script has one #SHOAL --prelude block", n + 1);
                }
                block = Some(Vec::new());
                task.push("#".to_owned());
                continue;
            }
            Some("--end-prelude") => {
                let Some(lines) = block.take() else {
                    bail!(
                        "line {}: #SHOAL --end-prelude without #SHOAL --prelude",
                        n + 1
                    );
                };
                if prelude.is_some() {
                    bail!("the job has a prelude file and a #SHOAL --prelude block: one of them");
                }
                prelude = Some(lines.join("\n") + "\n");
                finished_block = true;
                task.push("#".to_owned());
                continue;
            }
            Some(d) if d.starts_with("--prelude=") => {
                let path = base.join(&d["--prelude=".len()..]);
                if prelude.is_none() {
                    prelude =
                        Some(std::fs::read_to_string(&path).with_context(|| {
                            format!("line {}: reading {}", n + 1, path.display())
                        })?);
                }
                task.push(line.to_owned());
                continue;
            }
            _ => {}
        }
        match &mut block {
            Some(lines) => {
                lines.push(line);
                task.push("#".to_owned());
            }
            None => task.push(line.to_owned()),
        }
    }
    if block.is_some() {
        bail!("#SHOAL --prelude without #SHOAL --end-prelude");
    }
    let mut task_body = task.join("\n");
    if body.ends_with('\n') {
        task_body.push('\n');
    }
    Ok(Split { task_body, prelude })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_block_runs_once_and_leaves_its_lines_blank_for_the_tasks() {
        let body = "#!/bin/bash\n#SBATCH --array=1-4\n#SHOAL --prelude\npython load.py\nsleep 20\n\
                    #SHOAL --end-prelude\necho task $SLURM_ARRAY_TASK_ID\n";
        let s = split(body, None, Path::new("/")).unwrap();
        assert_eq!(s.prelude.as_deref(), Some("python load.py\nsleep 20\n"));
        assert_eq!(
            s.task_body,
            "#!/bin/bash\n#SBATCH --array=1-4\n#\n#\n#\n#\necho task $SLURM_ARRAY_TASK_ID\n"
        );
        assert_eq!(s.task_body.lines().count(), body.lines().count());
    }

    #[test]
    fn a_file_or_nothing_and_clear_errors() {
        let plain = "#!/bin/sh\necho hi\n";
        let s = split(plain, None, Path::new("/")).unwrap();
        assert_eq!((s.task_body.as_str(), s.prelude), (plain, None));
        let s = split(plain, Some("load\n".into()), Path::new("/")).unwrap();
        assert_eq!(s.prelude.as_deref(), Some("load\n"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("warm.sh"), "warm\n").unwrap();
        let s = split(
            "#!/bin/sh\n#SHOAL --prelude=warm.sh\necho\n",
            None,
            dir.path(),
        )
        .unwrap();
        assert_eq!(s.prelude.as_deref(), Some("warm\n"));
        assert!(split("#!/bin/sh\n#SHOAL --prelude\necho\n", None, Path::new("/")).is_err());
        assert!(split("#!/bin/sh\n#SHOAL --end-prelude\n", None, Path::new("/")).is_err());
        assert!(split(
            "#!/bin/sh\n#SHOAL --prelude\na\n#SHOAL --end-prelude\n",
            Some("b".into()),
            Path::new("/")
        )
        .is_err());
    }
}
