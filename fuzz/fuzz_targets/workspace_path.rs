//! The lexical checks of a session request: a workspace path, an operation ID and a
//! command's environment (the part of the resolver that runs before the kernel's
//! `RESOLVE_BENEATH`). Whatever passes must not be able to name a place outside the
//! workspace by its spelling.
#![no_main]

use kruntimes_runtime_server::sessions::paths;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // gRPC strings are UTF-8.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for allow_empty in [false, true] {
        if paths::validate_path("path", text, allow_empty).is_ok() {
            assert!(allow_empty || !text.is_empty());
            assert!(text.len() <= paths::MAX_PATH_BYTES);
            assert!(!text.starts_with('/'), "accepted absolute {text:?}");
            assert!(!text.contains('\0'));
            if !text.is_empty() {
                for component in text.split('/') {
                    assert!(
                        !component.is_empty() && component != "." && component != "..",
                        "accepted {text:?}"
                    );
                    assert!(component.len() <= paths::MAX_COMPONENT_BYTES);
                    assert!(paths::is_component(component));
                }
            }
        }
    }
    if paths::is_component(text) {
        assert!(paths::validate_path("path", text, false).is_ok());
        assert!(paths::validate_path("path", &paths::join("d", text), false).is_ok());
    }
    let _ = paths::validate_operation_id(text);
    let env: Vec<(String, String)> = text
        .lines()
        .map(|line| {
            let (name, value) = line.split_once('=').unwrap_or((line, ""));
            (name.to_string(), value.to_string())
        })
        .collect();
    if paths::validate_command_env(&env).is_ok() {
        assert!(env.len() <= paths::MAX_COMMAND_ENV);
        for (name, value) in &env {
            assert!(!name.starts_with("KRUNTIME_"), "accepted {name:?}");
            assert!(!value.contains('\0'));
        }
    }
});
