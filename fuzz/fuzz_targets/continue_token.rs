//! The `continue` token of a paginated list.
#![no_main]

use kruntimes_apiserver::http::handlers::decode_cursor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    let _ = decode_cursor(token);
});
