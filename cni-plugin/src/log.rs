//! Where the plugin's `tracing` lines go: the conflist's `logFile`
//! (appended), or stderr when there is none or it cannot be opened; never
//! stdout, which belongs to the CNI result.

use std::{fs::OpenOptions, path::Path, sync::Mutex};

use tracing::Subscriber;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

/// The subscriber of one invocation: plain text, no colours, INFO and up.
pub fn subscriber(file: Option<&Path>) -> impl Subscriber + Send + Sync {
    let opened = file.and_then(|p| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .map_err(|e| {
                eprintln!(
                    "xdpcni: logging to stderr: cannot open {}: {e}",
                    p.display()
                )
            })
            .ok()
    });
    let writer = match opened {
        Some(f) => BoxMakeWriter::new(Mutex::new(f)),
        None => BoxMakeWriter::new(std::io::stderr),
    };
    tracing_subscriber::fmt()
        .with_writer(writer)
        .with_ansi(false)
        .with_target(false)
        .with_max_level(tracing::Level::INFO)
        .finish()
}
