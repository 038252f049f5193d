//! The outputs file a program writes through `KRUNTIME_OUTPUTS`: parsing and limits.
//!
//! A pure function over bytes: `KEY=VALUE` lines, blank lines and `#` comments. It owns
//! the bounds of Run outputs (the constants of `kruntimes_api::run`) and never reads a
//! file itself; the caller reads at most [`MAX_OUTPUTS_FILE_BYTES`].
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use kruntimes_api::run::{
    MAX_OUTPUT_KEY_BYTES, MAX_OUTPUT_KEYS, MAX_OUTPUT_VALUE_BYTES, MAX_OUTPUTS_TOTAL_BYTES,
};

/// The outputs file may be at most this long, comments included; a longer file is
/// [`OutputsError::TooLarge`] without being read further.
pub const MAX_OUTPUTS_FILE_BYTES: u64 = 4 * MAX_OUTPUTS_TOTAL_BYTES as u64;

/// Why an outputs file was refused. Both kinds fail the execution and are not retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputsError {
    /// Reason `OutputsInvalid`.
    #[error("outputs line {line}: {detail}")]
    Invalid { line: usize, detail: &'static str },
    /// Reason `OutputsTooLarge`.
    #[error("outputs exceed a limit: {detail}")]
    TooLarge { detail: String },
}

impl OutputsError {
    /// The stable reason of a failed execution.
    pub fn reason(&self) -> &'static str {
        match self {
            OutputsError::Invalid { .. } => "OutputsInvalid",
            OutputsError::TooLarge { .. } => "OutputsTooLarge",
        }
    }
}

/// Parses an outputs file.
///
/// Each line is blank, a comment (first non-blank character `#`), or `KEY=VALUE`. The key
/// is 1 to 128 bytes of ASCII letters, digits, `_`, `-` and `.`, not starting with a digit
/// nor `-`; the value is everything after the first `=`, up to the line end (a trailing
/// `\r` is dropped). A later line for the same key replaces the earlier one. The file must
/// be UTF-8. Limits: 64 keys, a key at most 128 bytes, a value at most 8 KiB, all keys and
/// values together at most 64 KiB.
pub fn parse(bytes: &[u8]) -> Result<BTreeMap<String, String>, OutputsError> {
    if bytes.len() as u64 > MAX_OUTPUTS_FILE_BYTES {
        return Err(OutputsError::TooLarge {
            detail: format!("the file is larger than {MAX_OUTPUTS_FILE_BYTES} bytes"),
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| OutputsError::Invalid {
        line: 1 + bytes[..e.valid_up_to()]
            .iter()
            .filter(|b| **b == b'\n')
            .count(),
        detail: "not UTF-8",
    })?;
    let mut outputs = BTreeMap::new();
    for (index, raw) in text.split('\n').enumerate() {
        let line_no = index + 1;
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(OutputsError::Invalid {
                line: line_no,
                detail: "expected KEY=VALUE",
            });
        };
        if key.is_empty() {
            return Err(OutputsError::Invalid {
                line: line_no,
                detail: "empty key",
            });
        }
        if key.len() > MAX_OUTPUT_KEY_BYTES {
            return Err(OutputsError::TooLarge {
                detail: format!("line {line_no}: key longer than {MAX_OUTPUT_KEY_BYTES} bytes"),
            });
        }
        if !valid_key(key) {
            return Err(OutputsError::Invalid {
                line: line_no,
                detail: "key must be letters, digits, '_', '-' or '.', not starting with a digit or '-'",
            });
        }
        if value.len() > MAX_OUTPUT_VALUE_BYTES {
            return Err(OutputsError::TooLarge {
                detail: format!(
                    "line {line_no}: value of {key} longer than {MAX_OUTPUT_VALUE_BYTES} bytes"
                ),
            });
        }
        outputs.insert(key.to_owned(), value.to_owned());
        if outputs.len() > MAX_OUTPUT_KEYS {
            return Err(OutputsError::TooLarge {
                detail: format!("more than {MAX_OUTPUT_KEYS} keys"),
            });
        }
    }
    let total: usize = outputs.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_OUTPUTS_TOTAL_BYTES {
        return Err(OutputsError::TooLarge {
            detail: format!("keys and values together exceed {MAX_OUTPUTS_TOTAL_BYTES} bytes"),
        });
    }
    Ok(outputs)
}

fn valid_key(key: &str) -> bool {
    let mut bytes = key.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_' || b == b'.');
    first_ok && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn accepted() {
        let cases: Vec<(&str, Vec<u8>, BTreeMap<String, String>)> = vec![
            ("empty file", b"".to_vec(), map(&[])),
            (
                "one pair",
                b"answer=42\n".to_vec(),
                map(&[("answer", "42")]),
            ),
            ("no final newline", b"a=1".to_vec(), map(&[("a", "1")])),
            (
                "comments and blanks",
                b"# header\n\n  # indented comment\na=1\n\n".to_vec(),
                map(&[("a", "1")]),
            ),
            (
                "value keeps '=' and spaces",
                b"url=a=b c \n".to_vec(),
                map(&[("url", "a=b c ")]),
            ),
            ("empty value", b"a=\n".to_vec(), map(&[("a", "")])),
            (
                "CRLF",
                b"a=1\r\nb=2\r\n".to_vec(),
                map(&[("a", "1"), ("b", "2")]),
            ),
            ("last wins", b"a=1\na=2\n".to_vec(), map(&[("a", "2")])),
            (
                "key charset",
                b"_x.y-z9=ok\n".to_vec(),
                map(&[("_x.y-z9", "ok")]),
            ),
            (
                "utf-8 value",
                "k=héllo ✓\n".as_bytes().to_vec(),
                map(&[("k", "héllo ✓")]),
            ),
            (
                "exactly 64 keys",
                (0..64)
                    .map(|i| format!("k{i}=v\n"))
                    .collect::<String>()
                    .into_bytes(),
                (0..64)
                    .map(|i| (format!("k{i}"), "v".to_string()))
                    .collect(),
            ),
            (
                "key of exactly 128 bytes",
                format!("{}=v", "k".repeat(128)).into_bytes(),
                map(&[(&"k".repeat(128), "v")]),
            ),
            (
                "value of exactly 8 KiB",
                format!("k={}", "v".repeat(8192)).into_bytes(),
                map(&[("k", &"v".repeat(8192))]),
            ),
        ];
        for (name, input, want) in cases {
            assert_eq!(parse(&input), Ok(want), "{name}");
        }
    }

    #[test]
    fn refused() {
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("no '='", b"just text\n".to_vec(), "OutputsInvalid"),
            ("empty key", b"=v\n".to_vec(), "OutputsInvalid"),
            ("space in key", b"a b=1\n".to_vec(), "OutputsInvalid"),
            ("leading digit", b"1a=1\n".to_vec(), "OutputsInvalid"),
            (
                "leading space before key",
                b" a=1\n".to_vec(),
                "OutputsInvalid",
            ),
            ("not UTF-8", b"a=\xff\xfe\n".to_vec(), "OutputsInvalid"),
            (
                "65 keys",
                (0..65)
                    .map(|i| format!("k{i}=v\n"))
                    .collect::<String>()
                    .into_bytes(),
                "OutputsTooLarge",
            ),
            (
                "key of 129 bytes",
                format!("{}=v", "k".repeat(129)).into_bytes(),
                "OutputsTooLarge",
            ),
            (
                "value over 8 KiB",
                format!("k={}", "v".repeat(8193)).into_bytes(),
                "OutputsTooLarge",
            ),
            (
                "total over 64 KiB",
                (0..9)
                    .map(|i| format!("k{i}={}\n", "v".repeat(8000)))
                    .collect::<String>()
                    .into_bytes(),
                "OutputsTooLarge",
            ),
            (
                "file over the read bound",
                vec![b'#'; MAX_OUTPUTS_FILE_BYTES as usize + 1],
                "OutputsTooLarge",
            ),
        ];
        for (name, input, reason) in cases {
            let err = parse(&input).unwrap_err();
            assert_eq!(err.reason(), reason, "{name}: {err}");
        }
    }

    #[test]
    fn invalid_names_its_line() {
        assert_eq!(
            parse(b"# c\na=1\nbroken\n"),
            Err(OutputsError::Invalid {
                line: 3,
                detail: "expected KEY=VALUE"
            })
        );
        assert!(matches!(
            parse(b"a=1\nb=\xff"),
            Err(OutputsError::Invalid { line: 2, .. })
        ));
    }
}
