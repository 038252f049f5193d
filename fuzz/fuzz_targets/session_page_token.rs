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
    // The server decodes and encodes only for a directory it validated first: a longer
    // one (a 9,645-byte directory of NULs, found here) encodes past the token bound.
    let valid_dir = paths::validate_path("path", dir, true).is_ok();
    if let Ok(after) = cursor::decode(token, dir) {
        assert!(
            paths::is_component(&after),
            "a token resumed after {after:?}"
        );
        if valid_dir {
            assert_eq!(
                cursor::decode(&cursor::encode(dir, &after), dir).as_deref(),
                Ok(after.as_str())
            );
        }
    }
    // What the server hands out always comes back.
    if valid_dir && paths::is_component(token) {
        assert_eq!(
            cursor::decode(&cursor::encode(dir, token), dir).as_deref(),
            Ok(token)
        );
    }
});
