//! The page token of ListSessionFiles: base64url without padding of the JSON object
//! `{"v":1,"path":<directory>,"after":<last name returned>}` (design document 001,
//! "ListSessionFiles"; `runtime.proto`).
//!
//! Owns encoding and strict decoding: a token that is not canonical unpadded base64url, not
//! that exact JSON shape, of another version, for another directory or with an `after`
//! that is not one valid name is refused. The format is shared with every runtime server,
//! so a token from one ready worker pages on another. It never reads a directory.
#![forbid(unsafe_code)]

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

use super::paths;

/// The only version of the token.
pub const TOKEN_VERSION: u32 = 1;
/// A longer token is refused before it is decoded. A directory of 4096 bytes whose every
/// byte JSON escapes as `\u00XX`, plus a name, fits.
pub const MAX_TOKEN_BYTES: usize = 64 * 1024;

/// Why a page token was refused. Never carries the token itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("page_token is longer than {MAX_TOKEN_BYTES} bytes")]
    TooLong,
    #[error("page_token is not unpadded base64url")]
    Encoding,
    #[error("page_token does not hold a page cursor")]
    Malformed,
    #[error("page_token has version {0}; this server reads version {TOKEN_VERSION}")]
    Version(u32),
    #[error("page_token was made for another directory")]
    OtherDirectory,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Token<'a> {
    v: u32,
    #[serde(borrow)]
    path: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    after: std::borrow::Cow<'a, str>,
}

/// The token that resumes the listing of `dir` strictly after `after`.
pub fn encode(dir: &str, after: &str) -> String {
    let token = Token {
        v: TOKEN_VERSION,
        path: dir.into(),
        after: after.into(),
    };
    // Serializing two strings and a number cannot fail.
    let json = serde_json::to_vec(&token).unwrap_or_default();
    URL_SAFE_NO_PAD.encode(json)
}

/// The name after which the listing of `dir` resumes. `dir` is the request's (validated)
/// directory; a token made for any other fails.
pub fn decode(token: &str, dir: &str) -> Result<String, TokenError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::TooLong);
    }
    let json = URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| TokenError::Encoding)?;
    let parsed: Token<'_> = serde_json::from_slice(&json).map_err(|_| TokenError::Malformed)?;
    if parsed.v != TOKEN_VERSION {
        return Err(TokenError::Version(parsed.v));
    }
    if parsed.path != dir {
        return Err(TokenError::OtherDirectory);
    }
    if !paths::is_component(&parsed.after) {
        return Err(TokenError::Malformed);
    }
    Ok(parsed.after.into_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_documented_example() {
        // docs/session-mode.md and design document 001.
        let token = "eyJ2IjoxLCJwYXRoIjoiIiwiYWZ0ZXIiOiJidWlsZC5sb2cifQ";
        assert_eq!(encode("", "build.log"), token);
        assert_eq!(decode(token, "").unwrap(), "build.log");
    }

    #[test]
    fn round_trips() {
        for (dir, after) in [
            ("", "a"),
            ("src/lib", "z\u{ff0e}"),
            ("\u{1}\u{7f}\"\\", "\u{202e}x"),
            ("d", &"n".repeat(255)),
        ] {
            let token = encode(dir, after);
            assert!(!token.contains('='), "{token}");
            assert!(!token.contains('+') && !token.contains('/'), "{token}");
            assert_eq!(decode(&token, dir).unwrap(), after);
        }
        // The worst directory still fits the bound.
        let dir = vec!["\u{1}"; 2048].join("/");
        let token = encode(&dir, &"\u{1}".repeat(255));
        assert!(token.len() <= MAX_TOKEN_BYTES, "{}", token.len());
        assert!(decode(&token, &dir).is_ok());
    }

    /// Random text never panics the decoder, and only well-formed tokens pass.
    #[test]
    fn random_tokens_are_refused_without_panicking() {
        use rand::Rng;
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=+/!";
        let mut rng = rand::rng();
        for _ in 0..20_000 {
            let len = rng.random_range(0..64);
            let token: String = (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())] as char)
                .collect();
            if let Ok(after) = decode(&token, "") {
                assert!(paths::is_component(&after));
                assert_eq!(encode("", &after), token);
            }
            // Random JSON-ish bodies, properly encoded.
            let body: Vec<u8> = (0..len).map(|_| rng.random::<u8>()).collect();
            let _ = decode(&URL_SAFE_NO_PAD.encode(&body), "");
        }
    }

    #[test]
    fn refuses_tokens_of_other_directories() {
        let token = encode("a", "x");
        assert_eq!(decode(&token, "b"), Err(TokenError::OtherDirectory));
        assert_eq!(decode(&token, ""), Err(TokenError::OtherDirectory));
        assert_eq!(decode(&token, "a/"), Err(TokenError::OtherDirectory));
    }

    #[test]
    fn refuses_malformed_tokens() {
        let b64 = |s: &str| URL_SAFE_NO_PAD.encode(s);
        let cases = [
            ("!!!".to_owned(), TokenError::Encoding),
            // Padding is not allowed.
            (format!("{}=", b64("{}")), TokenError::Encoding),
            // Standard base64 alphabet.
            (
                base64::engine::general_purpose::STANDARD.encode([0xfb, 0xff]),
                TokenError::Encoding,
            ),
            (b64("not json"), TokenError::Malformed),
            (b64("{}"), TokenError::Malformed),
            (b64(r#"{"v":1,"path":""}"#), TokenError::Malformed),
            (
                b64(r#"{"v":1,"path":"","after":"a","x":1}"#),
                TokenError::Malformed,
            ),
            (
                b64(r#"{"v":"1","path":"","after":"a"}"#),
                TokenError::Malformed,
            ),
            (
                b64(r#"{"v":2,"path":"","after":"a"}"#),
                TokenError::Version(2),
            ),
            (
                b64(r#"{"v":1,"path":"","after":""}"#),
                TokenError::Malformed,
            ),
            (
                b64(r#"{"v":1,"path":"","after":".."}"#),
                TokenError::Malformed,
            ),
            (
                b64(r#"{"v":1,"path":"","after":"a/b"}"#),
                TokenError::Malformed,
            ),
            (
                b64(r#"{"v":1,"path":"","after":"a\u0000"}"#),
                TokenError::Malformed,
            ),
            (
                b64(r#"{"v":1,"path":"","after":"a"} trailing"#),
                TokenError::Malformed,
            ),
            ("A".repeat(MAX_TOKEN_BYTES + 1), TokenError::TooLong),
        ];
        for (token, expected) in cases {
            assert_eq!(decode(&token, ""), Err(expected.clone()), "{token}");
            // The message never echoes the token.
            let message = expected.to_string();
            assert!(!message.contains(&token), "{message}");
        }
        // Not valid UTF-8 inside.
        let bad = URL_SAFE_NO_PAD.encode(b"{\"v\":1,\"path\":\"\",\"after\":\"\xff\"}");
        assert_eq!(decode(&bad, ""), Err(TokenError::Malformed));
    }
}
