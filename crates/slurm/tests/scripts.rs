//! Batch scripts written the way researchers write them for real clusters,
//! parsed end to end: every directive, the body that will run, the module
//! lines, each task's environment and output files, and the refusals.

use std::path::Path;
use std::time::Duration;

use shoal_slurm::{
    format_sacct, format_squeue, output_paths, parse_format, parse_script, parse_script_with_args,
    task_environment, ArrayTask, DepKind, JobRecord, JobRef, JobState, PatternContext, SlurmError,
    TaskDescription, TimeLimit,
};

const SWEEP: &str = r#"#!/bin/bash
#SBATCH --job-name=param_sweep
#SBATCH --array=0-199%20
#SBATCH --output=logs/%x_%A_%a.out
#SBATCH --error=logs/%x_%A_%a.err
#SBATCH --time=00:10:00
#SBATCH --mem=4G
#SBATCH --cpus-per-task=2
#SBATCH --partition=short
#SBATCH --requeue

# Parameter sweep: one seed per array task.
set -euo pipefail

module purge
module load python/3.11.5
module load scipy-stack/2023b

echo "Task ${SLURM_ARRAY_TASK_ID} of ${SLURM_ARRAY_TASK_COUNT} on $(hostname)"
mkdir -p results
python3 run.py --seed $SLURM_ARRAY_TASK_ID --out "results/seed_${SLURM_ARRAY_TASK_ID}.json"
"#;

#[test]
fn parameter_sweep() {
    let s = parse_script(SWEEP).unwrap();
    let d = &s.directives;
    assert_eq!(d.job_name.as_deref(), Some("param_sweep"));
    let array = d.array.as_ref().unwrap();
    assert_eq!(array.task_ids, (0..200).collect::<Vec<u32>>());
    assert_eq!(array.throttle, Some(20));
    assert_eq!(d.output.as_deref(), Some("logs/%x_%A_%a.out"));
    assert_eq!(d.error.as_deref(), Some("logs/%x_%A_%a.err"));
    assert_eq!(d.time, Some(TimeLimit::Limit(Duration::from_secs(600))));
    assert_eq!(d.time_limit(), Some(Duration::from_secs(600)));
    assert_eq!(d.mem_mib, Some(4096));
    assert_eq!(d.memory_mib(), Some(4096));
    assert_eq!(d.mem_per_cpu_mib, None);
    assert_eq!(d.cpus_per_task, Some(2));
    assert_eq!(d.partition.as_deref(), Some("short"));
    assert_eq!(d.requeue, Some(true));
    assert_eq!(d.nodes, None);
    assert_eq!(d.ntasks, None);
    assert_eq!(d.gres, None);
    assert_eq!(d.dependency, None);
    assert_eq!(d.account, None);
    assert_eq!(d.chdir, None);
    assert!(!d.parsable);
    assert_eq!(s.shebang.as_deref(), Some("/bin/bash"));
    assert!(s.srun_lines.is_empty());

    assert_eq!(
        s.module_lines,
        vec![
            (15, "module purge".to_string()),
            (16, "module load python/3.11.5".to_string()),
            (17, "module load scipy-stack/2023b".to_string()),
        ]
    );
    let w: Vec<String> = s.warnings.iter().map(|w| w.to_string()).collect();
    assert_eq!(
        w,
        vec![
            "line 15: skipped `module purge`: the template provides the software",
            "line 16: skipped `module load python/3.11.5`: the template provides the software",
            "line 17: skipped `module load scipy-stack/2023b`: the template provides the software",
        ]
    );

    // The body is the script, line for line, with the module commands
    // neutralised and everything else untouched.
    let original: Vec<&str> = SWEEP.lines().collect();
    let body: Vec<&str> = s.body.lines().collect();
    assert_eq!(body.len(), original.len());
    for (i, (b, o)) in body.iter().zip(&original).enumerate() {
        match i + 1 {
            15..=17 => assert_eq!(*b, format!("true  # shoal skipped: {o}")),
            _ => assert_eq!(b, o),
        }
    }
    assert!(s.body.contains("set -euo pipefail\n"));
    assert!(s.body.ends_with("python3 run.py --seed $SLURM_ARRAY_TASK_ID --out \"results/seed_${SLURM_ARRAY_TASK_ID}.json\"\n"));

    // Task 42 of array job 5000 (whose own job id is 5042).
    let env = task_environment(&TaskDescription {
        job_id: 5042,
        array: Some(ArrayTask::new(5000, 42, array)),
        job_name: d.job_name_or_default(Some("sweep.sh")),
        user: "ada".into(),
        partition: d.partition.clone(),
        cpus_per_task: d.cpus_per_task,
        cpus: d.cpus(),
        mem_per_node_mib: d.mem_mib,
        submit_dir: "/home/ada/sweep".into(),
        submit_host: "laptop".into(),
        node_name: "sb-7f3c".into(),
        cluster_name: "shoal".into(),
        ..Default::default()
    });
    for (k, v) in [
        ("SLURM_ARRAY_TASK_ID", "42"),
        ("SLURM_ARRAY_JOB_ID", "5000"),
        ("SLURM_JOB_ID", "5042"),
        ("SLURM_ARRAY_TASK_COUNT", "200"),
        ("SLURM_ARRAY_TASK_MIN", "0"),
        ("SLURM_ARRAY_TASK_MAX", "199"),
        ("SLURM_ARRAY_TASK_STEP", "1"),
        ("SLURM_JOB_NAME", "param_sweep"),
        ("SLURM_CPUS_PER_TASK", "2"),
        ("SLURM_MEM_PER_NODE", "4096"),
        ("SLURM_SUBMIT_DIR", "/home/ada/sweep"),
        ("SLURM_JOB_NUM_NODES", "1"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_JOB_PARTITION", "short"),
    ] {
        assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}");
    }

    let ctx = PatternContext {
        job_id: 5042,
        array_job_id: Some(5000),
        task_id: Some(42),
        job_name: "param_sweep".into(),
        user: "ada".into(),
        node: "sb-7f3c".into(),
    };
    let out = output_paths(
        d.output.as_deref(),
        d.error.as_deref(),
        &ctx,
        Path::new("/home/ada/sweep"),
    );
    assert_eq!(
        out.stdout,
        Path::new("/home/ada/sweep/logs/param_sweep_5000_42.out")
    );
    assert_eq!(
        out.stderr,
        Path::new("/home/ada/sweep/logs/param_sweep_5000_42.err")
    );
}

const ALIGN: &str = "#!/usr/bin/env bash
#SBATCH -J align           # job name
#SBATCH -p general
#SBATCH -c 4
#SBATCH --mem-per-cpu=2000
#SBATCH -t 1-00:00
#SBATCH -a 1-24:1
#SBATCH -o slurm-%A_%3a.log
#SBATCH --mail-type=END,FAIL
#SBATCH --mail-user=someone@example.edu
#SBATCH --dependency=afterok:81234
#SBATCH --account=genomics_lab

source /etc/profile.d/modules.sh
module load samtools/1.17 bwa/0.7.17

SAMPLE=$(sed -n \"${SLURM_ARRAY_TASK_ID}p\" samples.txt)
bwa mem -t \"$SLURM_CPUS_PER_TASK\" ref.fa \"${SAMPLE}_R1.fq.gz\" \"${SAMPLE}_R2.fq.gz\" \\
  | samtools sort -@ \"$SLURM_CPUS_PER_TASK\" -o \"bam/${SAMPLE}.bam\" -
";

#[test]
fn alignment_array_with_short_options() {
    let s = parse_script(ALIGN).unwrap();
    let d = &s.directives;
    assert_eq!(d.job_name.as_deref(), Some("align"));
    assert_eq!(d.partition.as_deref(), Some("general"));
    assert_eq!(d.cpus_per_task, Some(4));
    assert_eq!(d.mem_per_cpu_mib, Some(2000));
    assert_eq!(d.mem_mib, None);
    assert_eq!(d.memory_mib(), Some(8000));
    assert_eq!(d.time, Some(TimeLimit::Limit(Duration::from_secs(86_400))));
    let array = d.array.as_ref().unwrap();
    assert_eq!(array.task_ids, (1..=24).collect::<Vec<u32>>());
    assert_eq!(array.throttle, None);
    assert_eq!(d.output.as_deref(), Some("slurm-%A_%3a.log"));
    assert_eq!(d.error, None);
    assert_eq!(d.account.as_deref(), Some("genomics_lab"));
    let dep = d.dependency.as_ref().unwrap();
    assert_eq!(dep.conditions.len(), 1);
    assert_eq!(dep.conditions[0].kind, DepKind::AfterOk);
    assert_eq!(
        dep.conditions[0].jobs,
        vec![JobRef {
            job_id: 81234,
            task_id: None
        }]
    );
    assert_eq!(d.requeue, None);
    assert_eq!(s.shebang.as_deref(), Some("/usr/bin/env bash"));

    assert_eq!(
        s.module_lines,
        vec![
            (14, "source /etc/profile.d/modules.sh".to_string()),
            (15, "module load samtools/1.17 bwa/0.7.17".to_string()),
        ]
    );
    let w: Vec<String> = s.warnings.iter().map(|w| w.to_string()).collect();
    assert_eq!(w.len(), 4, "{w:?}");
    assert_eq!(
        w[0],
        "line 9: --mail-type=END,FAIL ignored: Shoal sends no mail"
    );
    assert_eq!(
        w[1],
        "line 10: --mail-user=someone@example.edu ignored: Shoal sends no mail"
    );
    // The pipeline over a continued line is left exactly as written.
    assert!(s
        .body
        .contains("\"${SAMPLE}_R2.fq.gz\" \\\n  | samtools sort"));

    // Output and error share one file, padded as %3a asks.
    let ctx = PatternContext {
        job_id: 9007,
        array_job_id: Some(9000),
        task_id: Some(7),
        job_name: "align".into(),
        user: "bo".into(),
        node: "sb-1".into(),
    };
    let out = output_paths(
        d.output.as_deref(),
        d.error.as_deref(),
        &ctx,
        Path::new("/data/run"),
    );
    assert_eq!(out.stdout, Path::new("/data/run/slurm-9000_007.log"));
    assert!(out.same_file());

    let env = task_environment(&TaskDescription {
        job_id: 9007,
        array: Some(ArrayTask::new(9000, 7, array)),
        cpus_per_task: d.cpus_per_task,
        cpus: d.cpus(),
        mem_per_cpu_mib: d.mem_per_cpu_mib,
        account: d.account.clone(),
        ..Default::default()
    });
    assert_eq!(env["SLURM_ARRAY_TASK_MIN"], "1");
    assert_eq!(env["SLURM_ARRAY_TASK_MAX"], "24");
    assert_eq!(env["SLURM_MEM_PER_CPU"], "2000");
    assert_eq!(env["SLURM_JOB_ACCOUNT"], "genomics_lab");
    assert!(!env.contains_key("SLURM_MEM_PER_NODE"));
}

const STEPPED: &str = "#!/bin/sh
#SBATCH --array=1-3,7,10-20:5
#SBATCH --time=2-12
#SBATCH --mem 500M
#SBATCH --no-requeue
#SBATCH --nodes=1
#SBATCH --ntasks=1

./simulate --case $SLURM_ARRAY_TASK_ID
";

#[test]
fn stepped_list_array_defaults() {
    let s = parse_script(STEPPED).unwrap();
    let d = &s.directives;
    let array = d.array.as_ref().unwrap();
    assert_eq!(array.task_ids, vec![1, 2, 3, 7, 10, 15, 20]);
    assert_eq!(array.step(), 1, "irregular ids");
    assert_eq!(
        d.time,
        Some(TimeLimit::Limit(Duration::from_secs(
            2 * 86_400 + 12 * 3_600
        )))
    );
    assert_eq!(d.mem_mib, Some(500));
    assert_eq!(d.requeue, Some(false));
    assert_eq!(d.nodes, Some(1));
    assert_eq!(d.ntasks, Some(1));
    assert_eq!(d.job_name, None);
    assert_eq!(d.job_name_or_default(Some("jobs/stepped.sh")), "stepped.sh");
    assert_eq!(d.cpus(), 1);
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    assert!(s.module_lines.is_empty());
    assert_eq!(s.body, STEPPED, "nothing to change");

    // Without --output: slurm-%A_%a.out in the submit directory.
    let ctx = PatternContext {
        job_id: 77,
        array_job_id: Some(70),
        task_id: Some(15),
        ..Default::default()
    };
    let out = output_paths(None, None, &ctx, Path::new("/w"));
    assert_eq!(out.stdout, Path::new("/w/slurm-70_15.out"));
}

#[test]
fn command_line_over_the_script() {
    // `shoal sbatch --array=0-3 --time=5 job.sh`
    let s = parse_script_with_args(SWEEP, &["--array=0-3", "--time=5", "-p", "long"]).unwrap();
    let d = &s.directives;
    assert_eq!(d.array.as_ref().unwrap().task_ids, vec![0, 1, 2, 3]);
    assert_eq!(d.array.as_ref().unwrap().throttle, None);
    assert_eq!(d.time, Some(TimeLimit::Limit(Duration::from_secs(300))));
    assert_eq!(d.partition.as_deref(), Some("long"));
    assert_eq!(d.mem_mib, Some(4096), "the script's other directives stay");
}

const MPI_JOB: &str = "#!/bin/bash
#SBATCH --job-name=lj
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=32
#SBATCH --time=04:00:00

module load openmpi/4.1.5 lammps/2023
srun --mpi=pmix lmp -in in.lj
";

#[test]
fn multi_node_mpi_job_is_refused_with_reasons() {
    let err = parse_script(MPI_JOB).unwrap_err();
    let SlurmError::Refused(r) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].line, r[0].what.as_str()), (Some(3), "--nodes=4"));
    assert!(r[0].why.contains("one sandbox"));
    assert_eq!(
        (r[1].line, r[1].what.as_str()),
        (Some(8), "srun --mpi=pmix")
    );
    assert!(r[1].why.contains("MPI"));
    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "this job cannot run on Shoal: line 3: --nodes=4: a Shoal task runs in one sandbox"
        ),
        "{msg}"
    );
}

#[test]
fn mpirun_on_one_node_is_refused() {
    let script = "#!/bin/bash\n#SBATCH -N 1\n#SBATCH -n 16\nmodule load intel-mpi\nmpirun -np $SLURM_NTASKS ./wrf.exe\n";
    let SlurmError::Refused(r) = parse_script(script).unwrap_err() else {
        panic!()
    };
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].line, r[0].what.as_str()), (Some(5), "mpirun"));
}

#[test]
fn gpu_training_is_refused() {
    let script = "#!/bin/bash
#SBATCH --job-name=train
#SBATCH --gres=gpu:a100:1
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=12:00:00
module load cuda/12.2
python train.py --epochs 50
";
    let SlurmError::Refused(r) = parse_script(script).unwrap_err() else {
        panic!()
    };
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].line, Some(3));
    assert_eq!(r[0].what, "--gres=gpu:a100:1");
    assert_eq!(
        r[0].to_string(),
        "line 3: --gres=gpu:a100:1: Shoal sandboxes have no GPUs"
    );
}

#[test]
fn srun_with_several_tasks_is_refused() {
    let script = "#!/bin/bash\n#SBATCH --ntasks=4\n#SBATCH -c 1\nsrun python worker.py\n";
    let SlurmError::Refused(r) = parse_script(script).unwrap_err() else {
        panic!()
    };
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].line, Some(4));
    assert_eq!(r[0].what, "srun with --ntasks=4");
}

const GENERATOR: &str = r#"#!/bin/bash
#SBATCH -J gen
#SBATCH -a 0-9
#SBATCH -t 30

# Writes a follow-up MPI job for the big cluster; it is not run here.
cat > followup.sh <<'EOF'
#!/bin/bash
#SBATCH --nodes=8
module load openmpi
mpirun ./solver
EOF

echo "mpirun is not used here"   # nor module load
srun hostname
srun --ntasks=1 python prep.py "$SLURM_ARRAY_TASK_ID"
"#;

#[test]
fn here_documents_strings_and_comments_are_not_commands() {
    let s = parse_script(GENERATOR).unwrap();
    assert!(s.module_lines.is_empty(), "{:?}", s.module_lines);
    assert_eq!(
        s.srun_lines,
        vec![
            (15, "srun hostname".to_string()),
            (
                16,
                "srun --ntasks=1 python prep.py \"$SLURM_ARRAY_TASK_ID\"".to_string()
            ),
        ]
    );
    assert_eq!(s.body, GENERATOR, "the here-document is left intact");
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    assert_eq!(
        s.directives.time,
        Some(TimeLimit::Limit(Duration::from_secs(1_800)))
    );
    assert_eq!(s.directives.array.as_ref().unwrap().count(), 10);
}

#[test]
fn sacct_and_squeue_for_a_sweep() {
    let mut records: Vec<JobRecord> = (0..4)
        .map(|t| JobRecord {
            job_id: 5000 + u64::from(t),
            array_job_id: Some(5000),
            task_id: Some(t),
            name: "param_sweep".into(),
            user: "ada".into(),
            partition: "short".into(),
            alloc_cpus: 2,
            ..Default::default()
        })
        .collect();
    records[0].state = JobState::Completed;
    records[0].elapsed = Duration::from_secs(95);
    records[0].max_rss_bytes = Some(310_379_520);
    records[0].cost_usd = Some(0.000_421);
    records[1].state = JobState::Failed;
    records[1].exit_code = 1;
    records[1].elapsed = Duration::from_secs(12);
    records[2].state = JobState::Running;
    records[2].elapsed = Duration::from_secs(61);
    records[2].node = Some("sb-9".into());
    records[3].state = JobState::Pending;
    records[3].reason = Some("JobArrayTaskLimit".into());

    let fields = parse_format("JobID,JobName,State,ExitCode,Elapsed,MaxRSS,CPUTime,Cost").unwrap();
    assert_eq!(
        format_sacct(&records, &fields, true),
        "JobID|JobName|State|ExitCode|Elapsed|MaxRSS|CPUTime|Cost\n\
         5000_0|param_sweep|COMPLETED|0:0|00:01:35|303105K|00:03:10|0.000421\n\
         5000_1|param_sweep|FAILED|1:0|00:00:12||00:00:24|\n\
         5000_2|param_sweep|RUNNING|0:0|00:01:01||00:02:02|\n\
         5000_3|param_sweep|PENDING|0:0|00:00:00||00:00:00|\n"
    );
    let table = format_sacct(&records, &fields, false);
    assert_eq!(
        table.lines().next().unwrap(),
        "JobID           JobName      State ExitCode    Elapsed     MaxRSS    CPUTime       Cost "
    );
    assert_eq!(
        table.lines().nth(2).unwrap(),
        "5000_0       param_swe+  COMPLETED      0:0   00:01:35    303105K   00:03:10   0.000421 "
    );

    let q = format_squeue(&records);
    assert_eq!(
        q,
        "             JOBID PARTITION     NAME     USER ST       TIME  NODES NODELIST(REASON)\n\
         \x20           5000_2     short param_sw      ada  R       1:01      1 sb-9\n\
         \x20           5000_3     short param_sw      ada PD       0:00      1 (JobArrayTaskLimit)\n"
    );
}
