//! `PATCH` with `application/json-patch+json` (RFC 6902), applied to a stored Run as the
//! server does, then serialised as the store would.
#![no_main]

use kruntimes_apiserver::patch::{self, PatchKind};
use libfuzzer_sys::fuzz_target;

include!("common.rs");

fuzz_target!(|data: &[u8]| {
    let mut doc = stored_run();
    if patch::apply(&mut doc, PatchKind::Json, data).is_ok() {
        assert_storable(&doc);
    }
});
