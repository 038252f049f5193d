//! A one-line spinner on stderr while krt waits, drawn only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const FRAMES: [&str; 10] = ["⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"];

#[derive(Default)]
struct State {
    message: String,
    stopped: bool,
    drawn: bool,
    frame: usize,
}

/// A cheap handle; clones share one spinner. Without a terminal every method does nothing.
#[derive(Clone)]
pub struct Spinner {
    state: Option<Arc<Mutex<State>>>,
}

impl Spinner {
    /// Starts drawing `message` (on a terminal only). Must be called inside a tokio runtime.
    pub fn start(message: impl Into<String>) -> Spinner {
        if !std::io::stderr().is_terminal() {
            return Spinner { state: None };
        }
        let state = Arc::new(Mutex::new(State {
            message: message.into(),
            ..State::default()
        }));
        let ticker = Arc::clone(&state);
        tokio::spawn(async move {
            // Quick waits end before anything is drawn.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut interval = tokio::time::interval(Duration::from_millis(100));
            loop {
                interval.tick().await;
                let Ok(mut s) = ticker.lock() else { return };
                if s.stopped {
                    return;
                }
                let frame = FRAMES[s.frame % FRAMES.len()];
                s.frame = s.frame.wrapping_add(1);
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K{frame} {}", s.message);
                let _ = err.flush();
                s.drawn = true;
            }
        });
        Spinner { state: Some(state) }
    }

    pub fn set_message(&self, message: impl Into<String>) {
        if let Some(state) = &self.state
            && let Ok(mut s) = state.lock()
        {
            s.message = message.into();
        }
    }

    /// Clears the line and stops drawing for good. Idempotent.
    pub fn stop(&self) {
        if let Some(state) = &self.state
            && let Ok(mut s) = state.lock()
        {
            if s.drawn && !s.stopped {
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K");
                let _ = err.flush();
            }
            s.stopped = true;
        }
    }
}
