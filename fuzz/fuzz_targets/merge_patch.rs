//! `PATCH` with a merge patch: the first byte picks JSON merge, strategic merge (handled
//! as a merge) or apply (YAML); the rest is the body, applied to a stored Run.
#![no_main]

use kruntimes_apiserver::patch::{self, PatchKind};
use libfuzzer_sys::fuzz_target;

include!("common.rs");

fuzz_target!(|data: &[u8]| {
    let Some((selector, body)) = data.split_first() else {
        return;
    };
    let kind = match selector % 3 {
        0 => PatchKind::Merge,
        1 => PatchKind::StrategicMerge,
        _ => PatchKind::Apply,
    };
    let mut doc = stored_run();
    if patch::apply(&mut doc, kind, body).is_ok() {
        assert!(
            doc.is_object(),
            "a merge patch turned the object into {doc}"
        );
        assert_storable(&doc);
    }
});
