//! Log lines to the configured file (appended), or to stderr; never stdout,
//! which belongs to the CNI result.

use std::{
    fs::OpenOptions,
    io::Write,
    path::PathBuf,
    time::{SystemTime, UNIX_EPOCH},
};

/// A logger for one invocation.
pub struct Log {
    file: Option<PathBuf>,
    prefix: String,
}

impl Log {
    /// Logs to `file`, or stderr, with `prefix` (command and container).
    pub fn new(file: Option<PathBuf>, prefix: String) -> Self {
        Self { file, prefix }
    }

    fn line(&self, level: &str, msg: &str) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        let line = format!(
            "{ts:.3} {level} xdpcni[{}] {}: {msg}\n",
            std::process::id(),
            self.prefix
        );
        let written = self.file.as_ref().is_some_and(|p| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .and_then(|mut f| f.write_all(line.as_bytes()))
                .is_ok()
        });
        if !written {
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }

    /// Informational.
    pub fn info(&self, msg: &str) {
        self.line("INFO", msg);
    }

    /// Something went wrong but the command goes on.
    pub fn warn(&self, msg: &str) {
        self.line("WARN", msg);
    }
}
