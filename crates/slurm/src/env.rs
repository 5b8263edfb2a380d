//! The environment one task's batch script runs with: the `SLURM_*`
//! variables sbatch(1) lists under "OUTPUT ENVIRONMENT VARIABLES", with the
//! values a one-sandbox, one-task Shoal job has.
//!
//! Owns: the names and values of those variables.
//! May not: read the caller's environment, pick job ids or sandboxes, or
//! decide what else (PATH, HOME, user variables) a task inherits; the
//! caller merges this map with those.

use std::collections::BTreeMap;

use crate::array::ArraySpec;

/// The array part of a task: which array, which index, and the figures of
/// the whole array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayTask {
    /// `SLURM_ARRAY_JOB_ID`: the array's master job id (by Slurm's
    /// convention the job id of the array's first task).
    pub array_job_id: u64,
    /// `SLURM_ARRAY_TASK_ID`.
    pub task_id: u32,
    /// `SLURM_ARRAY_TASK_COUNT`.
    pub count: usize,
    /// `SLURM_ARRAY_TASK_MIN`.
    pub min: u32,
    /// `SLURM_ARRAY_TASK_MAX`.
    pub max: u32,
    /// `SLURM_ARRAY_TASK_STEP`.
    pub step: u32,
}

impl ArrayTask {
    /// The task `task_id` of the array `spec` submitted as `array_job_id`.
    pub fn new(array_job_id: u64, task_id: u32, spec: &ArraySpec) -> ArrayTask {
        ArrayTask {
            array_job_id,
            task_id,
            count: spec.count(),
            min: spec.min(),
            max: spec.max(),
            step: spec.step(),
        }
    }
}

/// What one task is, as far as its environment goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskDescription {
    /// `SLURM_JOB_ID` (and the older `SLURM_JOBID`): this task's own job id.
    pub job_id: u64,
    /// Set for a task of an array.
    pub array: Option<ArrayTask>,
    /// `SLURM_JOB_NAME`.
    pub job_name: String,
    /// `SLURM_JOB_USER`.
    pub user: String,
    /// `SLURM_JOB_PARTITION`, when the job named one or one was mapped.
    pub partition: Option<String>,
    /// `SLURM_JOB_ACCOUNT`, when `--account` was given.
    pub account: Option<String>,
    /// `--cpus-per-task`, when given (only then is `SLURM_CPUS_PER_TASK` set,
    /// as in Slurm).
    pub cpus_per_task: Option<u32>,
    /// vCPUs of the sandbox: `SLURM_CPUS_ON_NODE`, `SLURM_JOB_CPUS_PER_NODE`.
    pub cpus: u32,
    /// `SLURM_MEM_PER_NODE` in MiB, when `--mem` was given.
    pub mem_per_node_mib: Option<u64>,
    /// `SLURM_MEM_PER_CPU` in MiB, when `--mem-per-cpu` was given.
    pub mem_per_cpu_mib: Option<u64>,
    /// `SLURM_SUBMIT_DIR`: where `shoal sbatch` ran.
    pub submit_dir: String,
    /// `SLURM_SUBMIT_HOST`.
    pub submit_host: String,
    /// `SLURMD_NODENAME`, `SLURM_JOB_NODELIST`, `SLURM_NODELIST`: the
    /// sandbox id.
    pub node_name: String,
    /// `SLURM_CLUSTER_NAME`.
    pub cluster_name: String,
    /// `SLURM_RESTART_COUNT`: how many times the task was requeued.
    pub restart_count: u32,
}

/// The `SLURM_*` variables of one task, sorted by name.
///
/// Always set: `SLURM_JOB_ID`, `SLURM_JOBID`, `SLURM_JOB_NAME`,
/// `SLURM_JOB_USER`, `SLURM_SUBMIT_DIR`, `SLURM_SUBMIT_HOST`,
/// `SLURM_CLUSTER_NAME`, `SLURM_JOB_NUM_NODES=1`, `SLURM_NNODES=1`,
/// `SLURM_NTASKS=1`, `SLURM_NPROCS=1`, `SLURM_TASKS_PER_NODE=1`,
/// `SLURM_NODEID=0`, `SLURM_PROCID=0`, `SLURM_LOCALID=0`,
/// `SLURM_CPUS_ON_NODE`, `SLURM_JOB_CPUS_PER_NODE`, `SLURMD_NODENAME`,
/// `SLURM_JOB_NODELIST`, `SLURM_NODELIST`, `SLURM_RESTART_COUNT`.
/// For array tasks: `SLURM_ARRAY_JOB_ID`, `SLURM_ARRAY_TASK_ID`,
/// `SLURM_ARRAY_TASK_COUNT`, `SLURM_ARRAY_TASK_MIN`, `SLURM_ARRAY_TASK_MAX`,
/// `SLURM_ARRAY_TASK_STEP`. When requested: `SLURM_CPUS_PER_TASK`,
/// `SLURM_MEM_PER_NODE`, `SLURM_MEM_PER_CPU`, `SLURM_JOB_PARTITION`,
/// `SLURM_JOB_ACCOUNT`.
pub fn task_environment(task: &TaskDescription) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    set("SLURM_JOB_ID", task.job_id.to_string());
    set("SLURM_JOBID", task.job_id.to_string());
    set("SLURM_JOB_NAME", task.job_name.clone());
    set("SLURM_JOB_USER", task.user.clone());
    set("SLURM_SUBMIT_DIR", task.submit_dir.clone());
    set("SLURM_SUBMIT_HOST", task.submit_host.clone());
    set("SLURM_CLUSTER_NAME", task.cluster_name.clone());
    for k in [
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
    ] {
        set(k, "1".into());
    }
    set("SLURM_TASKS_PER_NODE", "1".into());
    for k in ["SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID"] {
        set(k, "0".into());
    }
    set("SLURM_CPUS_ON_NODE", task.cpus.to_string());
    set("SLURM_JOB_CPUS_PER_NODE", task.cpus.to_string());
    for k in ["SLURMD_NODENAME", "SLURM_JOB_NODELIST", "SLURM_NODELIST"] {
        set(k, task.node_name.clone());
    }
    set("SLURM_RESTART_COUNT", task.restart_count.to_string());
    if let Some(a) = &task.array {
        set("SLURM_ARRAY_JOB_ID", a.array_job_id.to_string());
        set("SLURM_ARRAY_TASK_ID", a.task_id.to_string());
        set("SLURM_ARRAY_TASK_COUNT", a.count.to_string());
        set("SLURM_ARRAY_TASK_MIN", a.min.to_string());
        set("SLURM_ARRAY_TASK_MAX", a.max.to_string());
        set("SLURM_ARRAY_TASK_STEP", a.step.to_string());
    }
    if let Some(c) = task.cpus_per_task {
        set("SLURM_CPUS_PER_TASK", c.to_string());
    }
    if let Some(m) = task.mem_per_node_mib {
        set("SLURM_MEM_PER_NODE", m.to_string());
    }
    if let Some(m) = task.mem_per_cpu_mib {
        set("SLURM_MEM_PER_CPU", m.to_string());
    }
    if let Some(p) = &task.partition {
        set("SLURM_JOB_PARTITION", p.clone());
    }
    if let Some(a) = &task.account {
        set("SLURM_JOB_ACCOUNT", a.clone());
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::parse_array;

    fn base() -> TaskDescription {
        TaskDescription {
            job_id: 1042,
            array: None,
            job_name: "sweep".into(),
            user: "ada".into(),
            partition: None,
            account: None,
            cpus_per_task: None,
            cpus: 2,
            mem_per_node_mib: None,
            mem_per_cpu_mib: None,
            submit_dir: "/home/ada/proj".into(),
            submit_host: "laptop".into(),
            node_name: "sb-3f2a".into(),
            cluster_name: "shoal".into(),
            restart_count: 0,
        }
    }

    #[test]
    fn array_task() {
        let spec = parse_array("0-199%20").unwrap();
        let t = TaskDescription {
            array: Some(ArrayTask::new(1000, 42, &spec)),
            cpus_per_task: Some(2),
            mem_per_node_mib: Some(4096),
            partition: Some("short".into()),
            ..base()
        };
        let env = task_environment(&t);
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("SLURM_JOB_ID"), Some("1042"));
        assert_eq!(get("SLURM_JOBID"), Some("1042"));
        assert_eq!(get("SLURM_ARRAY_JOB_ID"), Some("1000"));
        assert_eq!(get("SLURM_ARRAY_TASK_ID"), Some("42"));
        assert_eq!(get("SLURM_ARRAY_TASK_COUNT"), Some("200"));
        assert_eq!(get("SLURM_ARRAY_TASK_MIN"), Some("0"));
        assert_eq!(get("SLURM_ARRAY_TASK_MAX"), Some("199"));
        assert_eq!(get("SLURM_ARRAY_TASK_STEP"), Some("1"));
        assert_eq!(get("SLURM_JOB_NAME"), Some("sweep"));
        assert_eq!(get("SLURM_CPUS_PER_TASK"), Some("2"));
        assert_eq!(get("SLURM_SUBMIT_DIR"), Some("/home/ada/proj"));
        assert_eq!(get("SLURM_JOB_NUM_NODES"), Some("1"));
        assert_eq!(get("SLURM_NTASKS"), Some("1"));
        assert_eq!(get("SLURM_MEM_PER_NODE"), Some("4096"));
        assert_eq!(get("SLURM_JOB_PARTITION"), Some("short"));
        assert_eq!(get("SLURMD_NODENAME"), Some("sb-3f2a"));
        assert_eq!(get("SLURM_JOB_NODELIST"), Some("sb-3f2a"));
        assert_eq!(get("SLURM_CPUS_ON_NODE"), Some("2"));
        assert_eq!(get("SLURM_RESTART_COUNT"), Some("0"));
        assert_eq!(get("SLURM_MEM_PER_CPU"), None);
        assert!(env.keys().all(|k| k.starts_with("SLURM")));
    }

    #[test]
    fn stepped_array() {
        let spec = parse_array("0-20:5").unwrap();
        let env = task_environment(&TaskDescription {
            array: Some(ArrayTask::new(7, 15, &spec)),
            ..base()
        });
        assert_eq!(env["SLURM_ARRAY_TASK_STEP"], "5");
        assert_eq!(env["SLURM_ARRAY_TASK_COUNT"], "5");
        assert_eq!(env["SLURM_ARRAY_TASK_MAX"], "20");
    }

    #[test]
    fn single_job_has_no_array_variables() {
        let env = task_environment(&base());
        assert!(env.keys().all(|k| !k.starts_with("SLURM_ARRAY_")));
        assert!(
            !env.contains_key("SLURM_CPUS_PER_TASK"),
            "only set when requested"
        );
        assert!(!env.contains_key("SLURM_MEM_PER_NODE"));
        assert!(!env.contains_key("SLURM_JOB_PARTITION"));
        assert_eq!(env["SLURM_JOB_ID"], "1042");
    }

    #[test]
    fn requeued_task_and_per_cpu_memory() {
        let env = task_environment(&TaskDescription {
            restart_count: 2,
            mem_per_cpu_mib: Some(1024),
            account: Some("lab".into()),
            ..base()
        });
        assert_eq!(env["SLURM_RESTART_COUNT"], "2");
        assert_eq!(env["SLURM_MEM_PER_CPU"], "1024");
        assert_eq!(env["SLURM_JOB_ACCOUNT"], "lab");
    }
}
