//! What the gateway's test binaries share: a capture of every log line this process
//! writes, to check that no raw token is ever logged.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Result, ensure};

/// Every log line of this test process, at every level, from every crate.
pub fn captured_logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink(logs.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        // Only this helper installs a global subscriber in this test binary.
        let _ = tracing::subscriber::set_global_default(subscriber);
        logs
    })
}

#[derive(Clone)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Fails, without printing the token, when any captured line contains it.
pub fn assert_token_never_logged(token: &str) -> Result<()> {
    let logs = captured_logs()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let text = String::from_utf8_lossy(&logs);
    ensure!(
        !text.is_empty(),
        "the log capture saw nothing; is it installed?"
    );
    let leaks: Vec<String> = text
        .lines()
        .filter(|line| line.contains(token))
        .map(|line| line.replace(token, "[TOKEN]"))
        .collect();
    ensure!(
        leaks.is_empty(),
        "{} of {} captured log lines carry the raw token:\n{}",
        leaks.len(),
        text.lines().count(),
        leaks.join("\n")
    );
    Ok(())
}
