//! A request body sent as `application/json`.
#![no_main]

use kruntimes_apiserver::http::handlers::decode_body;
use libfuzzer_sys::fuzz_target;

include!("common.rs");

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = decode_body("application/json", data) {
        assert!(value.is_object());
        assert_storable(&value);
    }
});
