//! `seff JOBID`: how well a job used what it asked for, in seff's words,
//! and (Shoal's own lines) what it cost and what the part it asked for and
//! left unused would cost where allocation is billed.

use std::time::Duration;

use crate::accounting::{JobRecord, JobState};
use crate::time::format_elapsed;

/// What one `seff` report covers: the tasks of one job, or one task.
pub struct SeffInput<'a> {
    pub records: &'a [&'a JobRecord],
    pub cluster: &'a str,
    /// The rate card: per CPU-hour and per GiB-hour, US dollars.
    pub rates: Option<(f64, f64)>,
    /// The VM memory of a task that asked for none (MiB).
    pub default_mem_mib: Option<u64>,
    /// Seconds of set-up a warm start ran once instead of per task, if it
    /// did (`#SHOAL --prelude`).
    pub prelude_seconds: Option<f64>,
}

/// seff's memory form: `12.34 MB`, `1.50 GB` (1024-based, as seff).
fn mem(bytes: f64) -> String {
    let mb = bytes / (1024.0 * 1024.0);
    if mb >= 1024.0 {
        format!("{:.2} GB", mb / 1024.0)
    } else {
        format!("{mb:.2} MB")
    }
}

fn percent(part: f64, whole: f64) -> String {
    if whole <= 0.0 {
        "0.00%".into()
    } else {
        format!("{:.2}%", 100.0 * part / whole)
    }
}

pub fn format_seff(input: &SeffInput) -> String {
    let recs = input.records;
    let mut out = String::new();
    let Some(first) = recs.first() else {
        return out;
    };
    if recs.len() == 1 {
        out.push_str(&format!("Job ID: {}\n", first.job_id));
        if let (Some(a), Some(t)) = (first.array_job_id, first.task_id) {
            out.push_str(&format!("Array Job ID: {a}_{t}\n"));
        }
    } else {
        out.push_str(&format!(
            "Job ID: {}\nArray tasks: {}\n",
            first.array_job_id.unwrap_or(first.job_id),
            recs.len()
        ));
    }
    out.push_str(&format!("Cluster: {}\n", input.cluster));
    out.push_str(&format!("User/Group: {}/{}\n", first.user, first.user));
    let state = if recs.iter().all(|r| r.state == first.state) {
        match first.state {
            JobState::Completed | JobState::Failed => {
                format!("{} (exit code {})", first.state.as_str(), first.exit_code)
            }
            s => s.as_str().to_owned(),
        }
    } else {
        let mut counts: Vec<(String, usize)> = Vec::new();
        for r in recs.iter() {
            match counts.iter_mut().find(|(s, _)| s == r.state.as_str()) {
                Some((_, n)) => *n += 1,
                None => counts.push((r.state.as_str().to_owned(), 1)),
            }
        }
        counts
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    out.push_str(&format!("State: {state}\n"));
    let cores = first.alloc_cpus.max(1);
    out.push_str(&format!("Cores: {cores}\n"));
    let wall: f64 = recs.iter().map(|r| r.elapsed.as_secs_f64()).sum();
    let core_wall: f64 = recs
        .iter()
        .map(|r| r.elapsed.as_secs_f64() * f64::from(r.alloc_cpus.max(1)))
        .sum();
    let cpu: f64 = recs
        .iter()
        .filter_map(|r| r.total_cpu.map(|d| d.as_secs_f64()))
        .sum();
    out.push_str(&format!(
        "CPU Utilized: {}\n",
        format_elapsed(Duration::from_secs_f64(cpu))
    ));
    out.push_str(&format!(
        "CPU Efficiency: {} of {} core-walltime\n",
        percent(cpu, core_wall),
        format_elapsed(Duration::from_secs_f64(core_wall))
    ));
    out.push_str(&format!(
        "Job Wall-clock time: {}\n",
        format_elapsed(Duration::from_secs_f64(wall))
    ));
    let peak = recs.iter().filter_map(|r| r.max_rss_bytes).max();
    let asked_mib = first.req_mem_mib.or(input.default_mem_mib);
    match peak {
        Some(p) => out.push_str(&format!("Memory Utilized: {}\n", mem(p as f64))),
        None => out.push_str("Memory Utilized: 0.00 MB (estimated maximum)\n"),
    }
    if let Some(asked) = asked_mib {
        let asked_bytes = asked as f64 * 1024.0 * 1024.0;
        out.push_str(&format!(
            "Memory Efficiency: {} of {}\n",
            percent(peak.unwrap_or(0) as f64, asked_bytes),
            mem(asked_bytes)
        ));
    }
    let cost: f64 = recs.iter().filter_map(|r| r.cost_usd).sum();
    out.push_str(&format!(
        "Cost: ${cost:.6} (Shoal meters use: CPU time and resident memory)\n"
    ));
    if let (Some((cpu_rate, gib_rate)), Some(asked)) = (input.rates, asked_mib) {
        let idle_core_s = (core_wall - cpu).max(0.0);
        let peak_gib = peak.unwrap_or(0) as f64 / (1u64 << 30) as f64;
        let idle_gib_s = ((asked as f64 / 1024.0 - peak_gib) * wall).max(0.0);
        let unused = idle_core_s / 3600.0 * cpu_rate + idle_gib_s / 3600.0 * gib_rate;
        out.push_str(&format!(
            "Unused allocation: {} core-walltime and {:.4} GB-hours asked for and not used; \
             billed by allocation they would cost ${unused:.6} more\n",
            format_elapsed(Duration::from_secs_f64(idle_core_s)),
            idle_gib_s / 3600.0
        ));
    }
    if let Some(saved) = input.prelude_seconds {
        let tasks = recs.len().saturating_sub(1) as f64;
        out.push_str(&format!(
            "Warm start: the {saved:.1} s prelude ran once, not per task: {} of task time saved\n",
            format_elapsed(Duration::from_secs_f64(saved * tasks))
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounting::JobState;

    fn rec(task: u32, cpu_s: u64, rss_mib: u64) -> JobRecord {
        JobRecord {
            job_id: 1000 + u64::from(task),
            array_job_id: Some(1000),
            task_id: Some(task),
            name: "sim".into(),
            user: "ada".into(),
            partition: "base".into(),
            account: None,
            state: JobState::Completed,
            exit_code: 0,
            signal: 0,
            elapsed: Duration::from_secs(10),
            alloc_cpus: 2,
            req_mem_mib: Some(1024),
            max_rss_bytes: Some(rss_mib << 20),
            total_cpu: Some(Duration::from_secs(cpu_s)),
            cost_usd: Some(0.001),
            submit: None,
            start: None,
            end: None,
            time_limit: None,
            node: None,
            reason: None,
            restarts: 0,
        }
    }

    #[test]
    fn one_task_reads_as_seff_prints_it() {
        let r = rec(3, 5, 256);
        let text = format_seff(&SeffInput {
            records: &[&r],
            cluster: "shoal",
            rates: Some((0.054, 0.0162)),
            default_mem_mib: None,
            prelude_seconds: None,
        });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Job ID: 1003");
        assert_eq!(lines[1], "Array Job ID: 1000_3");
        assert_eq!(lines[4], "State: COMPLETED (exit code 0)");
        assert_eq!(lines[5], "Cores: 2");
        assert_eq!(lines[6], "CPU Utilized: 00:00:05");
        assert_eq!(lines[7], "CPU Efficiency: 25.00% of 00:00:20 core-walltime");
        assert_eq!(lines[8], "Job Wall-clock time: 00:00:10");
        assert_eq!(lines[9], "Memory Utilized: 256.00 MB");
        assert_eq!(lines[10], "Memory Efficiency: 25.00% of 1.00 GB");
        assert!(
            lines[12].starts_with("Unused allocation: 00:00:15 core-walltime"),
            "{text}"
        );
    }

    #[test]
    fn an_array_sums_its_tasks_and_names_the_time_saved() {
        let (a, b) = (rec(1, 4, 100), rec(2, 6, 300));
        let text = format_seff(&SeffInput {
            records: &[&a, &b],
            cluster: "shoal",
            rates: None,
            default_mem_mib: None,
            prelude_seconds: Some(20.0),
        });
        assert!(text.contains("Array tasks: 2\n"), "{text}");
        assert!(
            text.contains("CPU Efficiency: 25.00% of 00:00:40 core-walltime"),
            "{text}"
        );
        assert!(text.contains("Memory Utilized: 300.00 MB"), "{text}");
        assert!(text.contains("00:00:20 of task time saved"), "{text}");
    }
}
