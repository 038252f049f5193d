// Shared by the targets that build objects (included with `include!`).

// A stored Run as the server holds it before a PATCH.
#[allow(dead_code)]
fn stored_run() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Run",
        "metadata": {
            "name": "r1",
            "namespace": "default",
            "uid": "6f1c2a4e-0000-4000-8000-000000000001",
            "resourceVersion": "42",
            "generation": 1,
            "labels": {"app": "web"},
            "finalizers": ["kruntimes.io/registration"]
        },
        "spec": {
            "runtime": "python",
            "mode": "task",
            "task": {"command": ["python", "-c", "print(1)"]},
            "resources": {"requests": {"runs": 1}}
        },
        "status": {
            "phase": "Running",
            "attempt": 1,
            "conditions": [{"type": "Scheduled", "status": "True"}]
        }
    })
}

// What the store writes, it must read back (sqlite.rs decodes with serde_json's limits).
fn assert_storable(value: &serde_json::Value) {
    let bytes = serde_json::to_vec(value).unwrap_or_else(|e| panic!("cannot serialise: {e}"));
    if let Err(e) = serde_json::from_slice::<serde_json::Value>(&bytes) {
        panic!("the store could not read back what it wrote: {e}");
    }
}
