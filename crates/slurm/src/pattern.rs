//! `--output`/`--error` file name patterns, expanded the way Slurm expands
//! them (`expand_stdio_fields` in Slurm's `print_fields.c`), and the
//! default names sbatch uses.
//!
//! Owns: `%A %a %b %j %J %s %N %n %t %u %x %%`, zero padding (`%3a`), the
//! `\` escape, the defaults `slurm-%A_%a.out` (arrays) and `slurm-%j.out`,
//! and resolving a relative name against the job's working directory.
//! May not: create, open or write files; the caller writes the output on
//! the submitting machine.

use std::path::{Path, PathBuf};

/// What `%a` becomes outside a job array: Slurm's `NO_VAL`, 4294967294
/// (job_array.html: "%a will be replaced by 4,294,967,294").
pub const NO_VAL_TASK_ID: u32 = 0xffff_fffe;

/// The values a pattern can refer to, for one task.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PatternContext {
    /// `%j`: this task's own job id.
    pub job_id: u64,
    /// `%A`: the array's master job id (`None` outside an array, when `%A`
    /// is the job id).
    pub array_job_id: Option<u64>,
    /// `%a`: the task's index (`None` outside an array).
    pub task_id: Option<u32>,
    /// `%x`.
    pub job_name: String,
    /// `%u`.
    pub user: String,
    /// `%N`: the short name of the node, in Shoal the sandbox id.
    pub node: String,
}

/// sbatch's default output name: `slurm-%A_%a.out` for an array,
/// `slurm-%j.out` otherwise.
pub fn default_output_pattern(is_array: bool) -> &'static str {
    if is_array {
        "slurm-%A_%a.out"
    } else {
        "slurm-%j.out"
    }
}

/// Expands a file name pattern for one task.
///
/// Exactly as Slurm: a `\` anywhere disables every replacement (and the
/// backslashes are dropped); `%%` is `%`; a number between `%` and the
/// letter zero-pads numeric fields (at most 10 wide, ignored for `%N %u
/// %x`); an unknown `%c` is left as it is; a trailing lone `%` is dropped.
/// Slurm's quirk for digits not followed by a known letter (`%5z` gives
/// `5z`, and a leading zero as in `%05a` gives `5a`) is kept, so names match
/// what a Slurm cluster would have written.
pub fn expand_pattern(pattern: &str, ctx: &PatternContext) -> String {
    if pattern.contains('\\') {
        return pattern.chars().filter(|&c| c != '\\').collect();
    }
    let chars: Vec<char> = pattern.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c != '%' {
            out.push(c);
            i += 1;
            continue;
        }
        // After a '%'.
        i += 1;
        let Some(&next) = chars.get(i) else { break };
        if next == '%' {
            out.push('%');
            i += 1;
            continue;
        }
        let mut padding = 0usize;
        if next.is_ascii_digit() {
            let start = i;
            let mut end = i;
            while end < chars.len() && chars[end].is_ascii_digit() {
                end += 1;
            }
            let digits: String = chars[start..end].iter().collect();
            let value: u64 = digits.parse().unwrap_or(u64::MAX);
            // strtoul reads every digit; above 9 the width is 10 and the
            // letter follows the digits, otherwise only one digit is taken.
            let letter_at = if value > 9 { end } else { start + 1 };
            match chars.get(letter_at) {
                Some(&l) if is_wildcard(l) => {
                    padding = if value > 9 { 10 } else { value as usize };
                    i = letter_at;
                }
                _ => {
                    // Slurm prints the last digit and goes on after it.
                    out.push(chars[end - 1]);
                    i = end;
                    continue;
                }
            }
        }
        let letter = chars[i];
        if is_wildcard(letter) {
            expand_wildcard(&mut out, letter, padding, ctx);
        } else {
            out.push('%');
            out.push(letter);
        }
        i += 1;
    }
    out
}

fn is_wildcard(c: char) -> bool {
    matches!(
        c,
        'A' | 'a' | 'b' | 'J' | 'j' | 'N' | 'n' | 's' | 't' | 'u' | 'x'
    )
}

fn expand_wildcard(out: &mut String, letter: char, pad: usize, ctx: &PatternContext) {
    let num = |n: u64| format!("{n:0pad$}");
    let task = ctx.task_id.unwrap_or(NO_VAL_TASK_ID);
    let text = match letter {
        'A' => num(ctx.array_job_id.unwrap_or(ctx.job_id)),
        // The batch script is not a numbered step, so %J is the job id.
        'j' | 'J' => num(ctx.job_id),
        'a' => num(u64::from(task)),
        'b' => num(u64::from(task % 10)),
        's' => "batch".to_string(),
        'n' | 't' => num(0),
        'N' => ctx.node.clone(),
        'u' => ctx.user.clone(),
        'x' => ctx.job_name.clone(),
        _ => unreachable!("checked by is_wildcard"),
    };
    out.push_str(&text);
}

/// Where one task's standard output and error go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputPaths {
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl OutputPaths {
    /// Both streams go to one file (no `--error`, or the same name).
    pub fn same_file(&self) -> bool {
        self.stdout == self.stderr
    }
}

/// The files a task's output is written to, as sbatch decides: `--output`
/// or the default name for stdout; `--error` for stderr, else stderr shares
/// stdout's file. Relative names are under `work_dir` (the submit
/// directory, or `--chdir`).
pub fn output_paths(
    output: Option<&str>,
    error: Option<&str>,
    ctx: &PatternContext,
    work_dir: &Path,
) -> OutputPaths {
    let is_array = ctx.task_id.is_some();
    let resolve = |pattern: &str| -> PathBuf {
        let name = expand_pattern(pattern, ctx);
        let p = Path::new(&name);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            work_dir.join(p)
        }
    };
    let stdout = resolve(output.unwrap_or(default_output_pattern(is_array)));
    let stderr = match error {
        Some(e) => resolve(e),
        None => stdout.clone(),
    };
    OutputPaths { stdout, stderr }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> PatternContext {
        PatternContext {
            job_id: 1042,
            array_job_id: Some(1000),
            task_id: Some(7),
            job_name: "sweep".into(),
            user: "ada".into(),
            node: "sb-3f2a".into(),
        }
    }

    fn single() -> PatternContext {
        PatternContext {
            job_id: 36,
            array_job_id: None,
            task_id: None,
            job_name: "tmp".into(),
            user: "mac".into(),
            node: "sb-1".into(),
        }
    }

    #[test]
    fn every_symbol() {
        let c = task();
        assert_eq!(expand_pattern("%A", &c), "1000");
        assert_eq!(expand_pattern("%a", &c), "7");
        assert_eq!(expand_pattern("%j", &c), "1042");
        assert_eq!(expand_pattern("%J", &c), "1042");
        assert_eq!(expand_pattern("%x", &c), "sweep");
        assert_eq!(expand_pattern("%u", &c), "ada");
        assert_eq!(expand_pattern("%N", &c), "sb-3f2a");
        assert_eq!(expand_pattern("%n-%t", &c), "0-0");
        assert_eq!(expand_pattern("%s", &c), "batch");
        assert_eq!(expand_pattern("%b", &task_with(17)), "7");
        assert_eq!(expand_pattern("100%%", &c), "100%");
    }

    fn task_with(id: u32) -> PatternContext {
        PatternContext {
            task_id: Some(id),
            ..task()
        }
    }

    #[test]
    fn researcher_patterns() {
        let c = task();
        assert_eq!(
            expand_pattern("logs/%x_%A_%a.out", &c),
            "logs/sweep_1000_7.out"
        );
        assert_eq!(expand_pattern("slurm-%A_%a.out", &c), "slurm-1000_7.out");
        assert_eq!(expand_pattern("%u-%x-%j", &c), "ada-sweep-1042");
        assert_eq!(expand_pattern("out/%x.%j.err", &c), "out/sweep.1042.err");
    }

    #[test]
    fn zero_padding() {
        let c = task();
        assert_eq!(expand_pattern("%3a", &c), "007");
        assert_eq!(expand_pattern("%4j", &c), "1042");
        assert_eq!(expand_pattern("%6A", &c), "001000");
        assert_eq!(expand_pattern("%12a", &c), "0000000007", "at most 10 wide");
        assert_eq!(expand_pattern("%5x", &c), "sweep", "names are not padded");
        assert_eq!(expand_pattern("%3u", &c), "ada");
        // print_fields.c examples: job%4j.out -> job0128.out
        let d = PatternContext {
            job_id: 128,
            ..single()
        };
        assert_eq!(expand_pattern("job%4j.out", &d), "job0128.out");
        assert_eq!(expand_pattern("job%2j-%2t.out", &d), "job128-00.out");
    }

    #[test]
    fn slurm_quirks_are_kept() {
        let c = task();
        assert_eq!(expand_pattern("%z", &c), "%z", "unknown letters stay");
        assert_eq!(expand_pattern("a%", &c), "a", "a trailing % is dropped");
        assert_eq!(expand_pattern("%5z", &c), "5z");
        assert_eq!(expand_pattern("%05a", &c), "5a");
        assert_eq!(expand_pattern("%123", &c), "3");
    }

    #[test]
    fn backslash_disables_expansion() {
        let c = task();
        assert_eq!(expand_pattern("\\%A_%a.out", &c), "%A_%a.out");
        assert_eq!(expand_pattern("lo\\gs/%j", &c), "logs/%j");
    }

    #[test]
    fn outside_an_array() {
        // job_array.html: %A is the job id and %a is 4294967294.
        let c = single();
        assert_eq!(expand_pattern("%A_%a", &c), "36_4294967294");
        assert_eq!(expand_pattern("%b", &c), "4");
    }

    #[test]
    fn defaults() {
        assert_eq!(default_output_pattern(true), "slurm-%A_%a.out");
        assert_eq!(default_output_pattern(false), "slurm-%j.out");
        let p = output_paths(None, None, &task(), Path::new("/home/ada/proj"));
        assert_eq!(p.stdout, Path::new("/home/ada/proj/slurm-1000_7.out"));
        assert!(p.same_file());
        let p = output_paths(None, None, &single(), Path::new("/w"));
        assert_eq!(p.stdout, Path::new("/w/slurm-36.out"));
    }

    #[test]
    fn output_and_error() {
        let w = Path::new("/w");
        let p = output_paths(
            Some("logs/%x_%A_%a.out"),
            Some("logs/%x_%A_%a.err"),
            &task(),
            w,
        );
        assert_eq!(p.stdout, Path::new("/w/logs/sweep_1000_7.out"));
        assert_eq!(p.stderr, Path::new("/w/logs/sweep_1000_7.err"));
        assert!(!p.same_file());
        let p = output_paths(None, Some("err-%j"), &task(), w);
        assert_eq!(p.stdout, Path::new("/w/slurm-1000_7.out"));
        assert_eq!(p.stderr, Path::new("/w/err-1042"));
        let p = output_paths(Some("/scratch/%j.log"), None, &task(), w);
        assert_eq!(p.stdout, Path::new("/scratch/1042.log"));
        assert_eq!(p.stderr, p.stdout);
    }
}
