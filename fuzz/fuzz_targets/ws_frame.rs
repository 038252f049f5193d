//! A text frame on the session WebSocket, and the rejection the gateway sends back.
#![no_main]

use kruntimes_gateway::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // tungstenite hands over only valid UTF-8 text frames.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(rejection) = fuzzing::ws_frame(text) {
        let value: serde_json::Value =
            serde_json::from_str(&rejection).unwrap_or_else(|e| panic!("{e}: {rejection}"));
        assert_eq!(value["type"], "rejected", "{rejection}");
        // A rejection echoes at most an operation ID and a bounded message.
        assert!(
            rejection.len() <= 4096,
            "a rejection of {} bytes",
            rejection.len()
        );
    }
});
