//! `fieldSelector` of a list or watch, with the fields a Run supports.
#![no_main]

use kruntimes_apiserver::resources;
use kruntimes_apiserver::selectors::FieldSelector;
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Some(def) = resources::find("kruntimes.io", "v1alpha1", "runs") else {
        panic!("the runs resource is missing");
    };
    if let Ok(selector) = FieldSelector::parse(text, |f| def.supports_field(f)) {
        for (field, _, _) in &selector.0 {
            assert!(
                def.supports_field(field),
                "accepted an unsupported field {field:?}"
            );
        }
        let run = json!({
            "metadata": {"name": "a", "namespace": "default"},
            "spec": {"runtime": "python"},
            "status": {"phase": "Running", "assignedPod": "w-1"}
        });
        selector.matches(|f| def.field_value(&run, f).map(str::to_string));
        selector.pinned_name();
    }
});
