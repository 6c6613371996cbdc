//! Progress on stderr: a spinner on a terminal, plain lines otherwise.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use cairn_engine::Progress;
use indicatif::{ProgressBar, ProgressStyle};

pub struct Steps {
    bar: Option<ProgressBar>,
    started: Instant,
}

impl Steps {
    pub fn new() -> Steps {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} [{elapsed:>3}] {msg}")
                    .expect("valid template"),
            );
            bar.enable_steady_tick(Duration::from_millis(100));
            bar
        });
        Steps {
            bar,
            started: Instant::now(),
        }
    }
}

impl Progress for Steps {
    fn step(&self, message: &str) {
        match &self.bar {
            Some(bar) => bar.set_message(message.to_string()),
            None => eprintln!(
                "cairn: [{:>5.1}s] {message}",
                self.started.elapsed().as_secs_f64()
            ),
        }
    }
}

impl Drop for Steps {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
