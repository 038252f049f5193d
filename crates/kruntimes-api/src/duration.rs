//! Parsing of `metav1.Duration` strings (`"90s"`, `"5m"`, `"1h30m"`, `"250ms"`), the format
//! Kubernetes uses for durations in specs.

use std::time::Duration;

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("duration is empty")]
    Empty,
    #[error("duration {0:?} is not of the form 1h2m3s (units: h, m, s, ms)")]
    Malformed(String),
    #[error("duration {0:?} is over 2562047h, the longest a Kubernetes duration holds")]
    Overflow(String),
}

/// The longest duration accepted: 2562047 hours (about 292 years), just under the largest
/// that Kubernetes' CEL `duration()` holds (int64 nanoseconds), so that a cluster and
/// standalone admission refuse the same durations.
pub const MAX: Duration = Duration::from_secs(2_562_047 * 3600);

/// Parses a non-negative Go-style duration made of `<number><unit>` pairs, where the units
/// are `h`, `m`, `s` and `ms`, and the numbers are whole. `"0"` alone is zero.
pub fn parse(input: &str) -> Result<Duration, DurationError> {
    if input.is_empty() {
        return Err(DurationError::Empty);
    }
    if input == "0" {
        return Ok(Duration::ZERO);
    }
    let malformed = || DurationError::Malformed(truncate(input));
    let bytes = input.as_bytes();
    let mut total: u128 = 0;
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if start == i || i - start > 18 {
            return Err(malformed());
        }
        let number: u128 = input[start..i].parse().map_err(|_| malformed())?;
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let millis_per_unit: u128 = match &input[unit_start..i] {
            "h" => 3_600_000,
            "m" => 60_000,
            "s" => 1_000,
            "ms" => 1,
            _ => return Err(malformed()),
        };
        total = total
            .checked_add(number * millis_per_unit)
            .ok_or_else(|| DurationError::Overflow(truncate(input)))?;
    }
    match u64::try_from(total).map(Duration::from_millis) {
        Ok(duration) if duration <= MAX => Ok(duration),
        _ => Err(DurationError::Overflow(truncate(input))),
    }
}

fn truncate(input: &str) -> String {
    input.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_usual_forms() {
        let cases = [
            ("0", 0),
            ("90s", 90_000),
            ("5m", 300_000),
            ("1h30m", 5_400_000),
            ("250ms", 250),
            ("1m0s", 60_000),
            ("2562047h", 2_562_047 * 3_600_000),
            ("2562046h60m", 2_562_047 * 3_600_000),
        ];
        for (text, millis) in cases {
            assert_eq!(parse(text), Ok(Duration::from_millis(millis)), "{text}");
        }
    }

    #[test]
    fn refuses_malformed_input() {
        for text in [
            "",
            "5",
            "s",
            "-5s",
            "1.5s",
            "5d",
            "5 s",
            "99999999999999999999h",
            "100000000000000000h",
            "2562047h1ms",
            "2562046h60m1ms",
        ] {
            assert!(parse(text).is_err(), "{text:?} must be refused");
        }
    }
}
