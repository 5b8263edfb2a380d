//! `--array` specifications: `0-15`, `1,3,5`, `0-20:2`, mixtures such as
//! `1-3,7,10-20:5`, an optional `%N` throttle, and the bracketed form
//! `[0-9]%2` some sites' examples use.
//!
//! Owns: turning a spec into sorted unique task ids and a throttle, and the
//! reverse (compressing ids into `1-3,7` for squeue's `JOBID_[...]`).
//! May not: decide job ids, schedule tasks or apply the throttle; callers do.
//!
//! Slurm's rules kept here: indexes are non-negative integers, a step only
//! follows a range, `%` introduces the limit on simultaneously running
//! tasks. Slurm's own cap is the site's `MaxArraySize`; Shoal's is
//! [`MAX_ARRAY_TASKS`] tasks per array.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::SlurmError;

/// Most tasks one `--array` may create.
pub const MAX_ARRAY_TASKS: usize = 100_000;

/// A parsed `--array`: the task ids in ascending order without duplicates,
/// and the most tasks that may run at once (`%N`), if limited.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArraySpec {
    pub task_ids: Vec<u32>,
    pub throttle: Option<u32>,
}

impl ArraySpec {
    /// `SLURM_ARRAY_TASK_COUNT`.
    pub fn count(&self) -> usize {
        self.task_ids.len()
    }

    /// `SLURM_ARRAY_TASK_MIN`.
    pub fn min(&self) -> u32 {
        self.task_ids.first().copied().unwrap_or(0)
    }

    /// `SLURM_ARRAY_TASK_MAX`.
    pub fn max(&self) -> u32 {
        self.task_ids.last().copied().unwrap_or(0)
    }

    /// `SLURM_ARRAY_TASK_STEP`: the common difference when the ids form one
    /// arithmetic progression (`0-20:2` gives 2, `1,3,5` gives 2), else 1
    /// (also for a single task).
    pub fn step(&self) -> u32 {
        let ids = &self.task_ids;
        if ids.len() < 2 {
            return 1;
        }
        let step = ids[1] - ids[0];
        if ids.windows(2).all(|w| w[1] - w[0] == step) {
            step
        } else {
            1
        }
    }

    /// The spec written back in Slurm's compact form, e.g. `0-9%2`.
    pub fn to_slurm_string(&self) -> String {
        let mut s = compress_ranges(&self.task_ids);
        if let Some(t) = self.throttle {
            s.push_str(&format!("%{t}"));
        }
        s
    }
}

/// Parses an `--array` value.
///
/// Errors (with the reason in the message): an empty spec or element, a
/// non-numeric index, a descending range (`5-1`), a zero or malformed step,
/// a step without a range (`5:2`), a zero or malformed throttle, and more
/// than [`MAX_ARRAY_TASKS`] tasks.
pub fn parse_array(spec: &str) -> Result<ArraySpec, SlurmError> {
    let err = |reason: &str| SlurmError::InvalidArray {
        spec: spec.to_string(),
        reason: reason.to_string(),
    };
    let trimmed = spec.trim();
    let (list, throttle) = match trimmed.rsplit_once('%') {
        Some((list, t)) => {
            let t = parse_index(t)
                .ok_or_else(|| err("the limit after % must be a whole number of tasks"))?;
            if t == 0 {
                return Err(err("the limit after % must be at least 1"));
            }
            (list, Some(t))
        }
        None => (trimmed, None),
    };
    let list = match list.strip_prefix('[') {
        Some(inner) => inner
            .strip_suffix(']')
            .ok_or_else(|| err("unbalanced brackets"))?,
        None => list,
    };
    if list.is_empty() {
        return Err(err("no task ids"));
    }
    let too_many = || err(&format!("more than {MAX_ARRAY_TASKS} tasks"));
    // A set bounds the work: a huge range fails as soon as the set passes
    // the cap, before it is expanded.
    let mut ids: BTreeSet<u32> = BTreeSet::new();
    for element in list.split(',') {
        let element = element.trim();
        if element.is_empty() {
            return Err(err("empty element in the list"));
        }
        let (range, step) = match element.split_once(':') {
            Some((range, step)) => {
                let step = parse_index(step)
                    .ok_or_else(|| err("the step after : must be a whole number"))?;
                if step == 0 {
                    return Err(err("the step after : must be at least 1"));
                }
                (range, Some(step))
            }
            None => (element, None),
        };
        match range.split_once('-') {
            Some((lo, hi)) => {
                let lo = parse_index(lo).ok_or_else(|| {
                    err("task ids must be whole numbers from 0 (negative ids do not exist)")
                })?;
                let hi = parse_index(hi).ok_or_else(|| err("task ids must be whole numbers"))?;
                if hi < lo {
                    return Err(err(&format!("range {lo}-{hi} is descending")));
                }
                let step = step.unwrap_or(1);
                let mut id = lo;
                loop {
                    ids.insert(id);
                    if ids.len() > MAX_ARRAY_TASKS {
                        return Err(too_many());
                    }
                    match id.checked_add(step) {
                        Some(next) if next <= hi => id = next,
                        _ => break,
                    }
                }
            }
            None => {
                if step.is_some() {
                    return Err(err("a step (:N) needs a range such as 0-20:2"));
                }
                let id = parse_index(range).ok_or_else(|| {
                    err("task ids must be whole numbers from 0 (negative ids do not exist)")
                })?;
                ids.insert(id);
                if ids.len() > MAX_ARRAY_TASKS {
                    return Err(too_many());
                }
            }
        }
    }
    let ids: Vec<u32> = ids.into_iter().collect();
    Ok(ArraySpec {
        task_ids: ids,
        throttle,
    })
}

fn parse_index(s: &str) -> Option<u32> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Writes ascending ids the way squeue shows an array's pending tasks:
/// runs of consecutive ids as `a-b`, others alone, comma separated
/// (`[1,2,3,7]` gives `1-3,7`). The ids must be sorted.
pub fn compress_ranges(ids: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let start = ids[i];
        let mut end = start;
        while i + 1 < ids.len() && ids[i + 1] == end + 1 {
            i += 1;
            end = ids[i];
        }
        if end == start {
            out.push(start.to_string());
        } else {
            out.push(format!("{start}-{end}"));
        }
        i += 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(spec: &str) -> Vec<u32> {
        parse_array(spec).unwrap().task_ids
    }

    fn reason(spec: &str) -> String {
        match parse_array(spec) {
            Err(SlurmError::InvalidArray { reason, .. }) => reason,
            other => panic!("expected an error for {spec:?}, got {other:?}"),
        }
    }

    #[test]
    fn plain_range() {
        assert_eq!(ids("0-15"), (0..=15).collect::<Vec<_>>());
        assert_eq!(parse_array("0-15").unwrap().throttle, None);
    }

    #[test]
    fn list() {
        assert_eq!(ids("1,3,5"), vec![1, 3, 5]);
        assert_eq!(ids("5,3,1"), vec![1, 3, 5], "sorted");
        assert_eq!(ids("1,1,2"), vec![1, 2], "unique");
    }

    #[test]
    fn single_index() {
        let a = parse_array("7").unwrap();
        assert_eq!(a.task_ids, vec![7]);
        assert_eq!((a.count(), a.min(), a.max(), a.step()), (1, 7, 7, 1));
    }

    #[test]
    fn stepped_range_as_in_the_manual() {
        // sbatch(1): "--array=0-15:4" is equivalent to "--array=0,4,8,12".
        assert_eq!(ids("0-15:4"), vec![0, 4, 8, 12]);
        assert_eq!(ids("0-20:2"), (0..=20).step_by(2).collect::<Vec<_>>());
        assert_eq!(ids("1-7:2"), vec![1, 3, 5, 7]);
    }

    #[test]
    fn mixture() {
        assert_eq!(ids("1-3,7,10-20:5"), vec![1, 2, 3, 7, 10, 15, 20]);
        assert_eq!(
            ids("0,6,16-32"),
            [0, 6].into_iter().chain(16..=32).collect::<Vec<_>>()
        );
        assert_eq!(
            ids("0-4,2-6"),
            (0..=6).collect::<Vec<_>>(),
            "overlaps merge"
        );
    }

    #[test]
    fn throttle() {
        let a = parse_array("0-199%20").unwrap();
        assert_eq!(a.count(), 200);
        assert_eq!(a.throttle, Some(20));
        assert_eq!(parse_array("1-3,7%1").unwrap().throttle, Some(1));
        assert_eq!(parse_array("0-15:4%2").unwrap().task_ids, vec![0, 4, 8, 12]);
    }

    #[test]
    fn brackets() {
        let a = parse_array("[2-2]%1").unwrap();
        assert_eq!(a.task_ids, vec![2]);
        assert_eq!(a.throttle, Some(1));
        assert_eq!(ids("[1,3]"), vec![1, 3]);
        assert!(reason("[1-3").contains("bracket"));
    }

    #[test]
    fn whitespace_around_is_tolerated() {
        assert_eq!(ids(" 1-3 "), vec![1, 2, 3]);
    }

    #[test]
    fn statistics_for_the_environment() {
        let a = parse_array("0-20:2").unwrap();
        assert_eq!((a.count(), a.min(), a.max(), a.step()), (11, 0, 20, 2));
        let b = parse_array("1,3,5").unwrap();
        assert_eq!(b.step(), 2);
        let c = parse_array("1,2,5").unwrap();
        assert_eq!(c.step(), 1, "irregular ids report step 1");
    }

    #[test]
    fn errors() {
        assert!(reason("").contains("no task ids"));
        assert!(reason("%4").contains("no task ids"));
        assert!(reason("1,,2").contains("empty element"));
        assert!(reason("1,").contains("empty element"));
        assert!(reason("5-1").contains("descending"));
        assert!(reason("a-b").contains("whole numbers"));
        assert!(reason("-1").contains("negative"));
        assert!(reason("1.5").contains("whole numbers"));
        assert!(reason("0-10:0").contains("at least 1"));
        assert!(reason("0-10:x").contains("step"));
        assert!(reason("5:2").contains("needs a range"));
        assert!(reason("0-9%0").contains("at least 1"));
        assert!(reason("0-9%x").contains("limit"));
        assert!(
            reason("0-99999999999").contains("whole numbers"),
            "overflow"
        );
    }

    #[test]
    fn task_cap() {
        assert_eq!(parse_array("0-99999").unwrap().count(), MAX_ARRAY_TASKS);
        assert!(reason("0-100000").contains("more than 100000"));
        assert!(reason("0-60000,60001-120000").contains("more than 100000"));
        assert_eq!(
            parse_array("0-60000,0-60000").unwrap().count(),
            60_001,
            "overlap is not double counted"
        );
        assert_eq!(parse_array("0-199998:2").unwrap().count(), 100_000);
        // A huge range is refused before it is expanded.
        assert!(reason("0-4000000000").contains("more than"));
    }

    #[test]
    fn compression() {
        assert_eq!(compress_ranges(&[1, 2, 3, 7]), "1-3,7");
        assert_eq!(compress_ranges(&[5]), "5");
        assert_eq!(compress_ranges(&[]), "");
        assert_eq!(compress_ranges(&[0, 2, 4]), "0,2,4");
        assert_eq!(compress_ranges(&[5, 6, 7, 8, 1024]), "5-8,1024");
    }

    #[test]
    fn round_trip_to_slurm_string() {
        assert_eq!(parse_array("1-3,7%2").unwrap().to_slurm_string(), "1-3,7%2");
        assert_eq!(parse_array("0-6:2").unwrap().to_slurm_string(), "0,2,4,6");
    }
}
