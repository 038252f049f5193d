//! The outputs file a task writes through `KRUNTIME_OUTPUTS`.
#![no_main]

use kruntimes_runtime_server::tasks::outputs;
use libfuzzer_sys::fuzz_target;

const MAX_KEYS: usize = 64;
const MAX_KEY_BYTES: usize = 128;
const MAX_VALUE_BYTES: usize = 8 * 1024;
const MAX_TOTAL_BYTES: usize = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    if let Ok(map) = outputs::parse(data) {
        assert!(map.len() <= MAX_KEYS);
        let mut total = 0;
        for (key, value) in &map {
            assert!(!key.is_empty() && key.len() <= MAX_KEY_BYTES, "{key:?}");
            assert!(value.len() <= MAX_VALUE_BYTES);
            assert!(!value.contains('\n'), "a value spans lines: {value:?}");
            total += key.len() + value.len();
        }
        assert!(total <= MAX_TOTAL_BYTES);
    }
});
