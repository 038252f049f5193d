//! The body of `POST {session}/operations` (one operation, NDJSON events back).
#![no_main]

use kruntimes_gateway::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = fuzzing::operation(data);
});
