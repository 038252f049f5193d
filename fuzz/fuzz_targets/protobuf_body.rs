//! A request body sent as `application/vnd.kubernetes.protobuf` (kubectl's typed
//! commands). Each input is tried as it is and behind the envelope's magic, so the fuzzer
//! spends its time inside the envelope.
#![no_main]

use kruntimes_apiserver::http::handlers::decode_body;
use libfuzzer_sys::fuzz_target;

include!("common.rs");

const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = decode_body(PROTOBUF, data) {
        assert!(value.is_object());
    }
    let mut enveloped = b"k8s\0".to_vec();
    enveloped.extend_from_slice(data);
    if let Ok(value) = decode_body(PROTOBUF, &enveloped) {
        assert!(value.is_object());
        assert_storable(&value);
    }
});
