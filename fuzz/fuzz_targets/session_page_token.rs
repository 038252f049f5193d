//! The page token of ListSessionFiles. Input: the directory, a newline, the token.
#![no_main]

use kruntimes_runtime_server::sessions::{cursor, paths};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // gRPC strings are UTF-8.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (dir, token) = text.split_once('\n').unwrap_or(("", text));
    if let Ok(after) = cursor::decode(token, dir) {
        assert!(
            paths::is_component(&after),
            "a token resumed after {after:?}"
        );
        assert_eq!(
            cursor::decode(&cursor::encode(dir, &after), dir).as_deref(),
            Ok(after.as_str())
        );
    }
    // What the server hands out always comes back.
    if paths::is_component(token) {
        assert_eq!(
            cursor::decode(&cursor::encode(dir, token), dir).as_deref(),
            Ok(token)
        );
    }
});
