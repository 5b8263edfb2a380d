//! Step progress: one `indicatif` spinner per build step on the caller's
//! `MultiProgress`, plus a timing report of every step.
//!
//! Owns presentation only; the steps themselves live in their modules.

use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

/// What happened in one build step, for logs and the CLI's summary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepReport {
    pub step: String,
    /// True when the layer was already built and the step did nothing.
    pub cached: bool,
    pub duration: Duration,
    pub detail: String,
}

/// A running step: a spinner that shows the latest message.
pub(crate) struct Step {
    bar: ProgressBar,
    name: &'static str,
    started: Instant,
}

impl Step {
    pub(crate) fn start(
        progress: &MultiProgress,
        name: &'static str,
        message: impl Into<String>,
    ) -> Self {
        let bar = progress.add(ProgressBar::new_spinner());
        bar.set_style(
            ProgressStyle::with_template("{spinner:.cyan} {prefix:<16} {wide_msg} [{elapsed}]")
                .expect("static template is valid")
                .tick_chars("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏✔"),
        );
        bar.set_prefix(name);
        bar.set_message(message.into());
        bar.enable_steady_tick(Duration::from_millis(120));
        tracing::info!(step = name, "started");
        Step {
            bar,
            name,
            started: Instant::now(),
        }
    }

    pub(crate) fn message(&self, message: impl Into<String>) {
        self.bar.set_message(message.into());
    }

    /// Ends the step, leaving its line on screen with the outcome.
    pub(crate) fn finish(self, cached: bool, detail: impl Into<String>) -> StepReport {
        let detail = detail.into();
        let duration = self.started.elapsed();
        let shown = if cached {
            format!("{detail} (cached)")
        } else {
            format!("{detail} ({:.1} s)", duration.as_secs_f64())
        };
        self.bar.finish_with_message(shown);
        tracing::info!(step = self.name, cached, ?duration, %detail, "finished");
        StepReport {
            step: self.name.to_string(),
            cached,
            duration,
            detail,
        }
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        // A step dropped without `finish` failed: stop the spinner so the
        // terminal is left clean for the error message.
        if !self.bar.is_finished() {
            self.bar.abandon_with_message("failed");
        }
    }
}
