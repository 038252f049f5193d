//! `labelSelector` of a list or watch: parsed, then matched against an object.
#![no_main]

use kruntimes_apiserver::selectors::LabelSelector;
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fuzz_target!(|data: &[u8]| {
    // A query parameter reaches the parser as UTF-8 (the server refuses other bytes).
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(selector) = LabelSelector::parse(text) {
        let object = json!({"metadata": {"labels": {"app": "web", "tier": "front", "a.b/c": "x"}}});
        selector.matches(&object);
        selector.matches(&json!({"metadata": {}}));
    }
});
