//! The stdout and stderr log files of an execution: bounded tails and chunked reads.
//!
//! A program writes its streams straight into two files of its workspace (no pipes, so a
//! background grandchild holding them open cannot stall anything). This module reads those
//! files back, always within a fixed bound; it never writes them. It also bounds streams
//! the server reads itself: one function invocation's share of a log file
//! ([`read_span_tail`]) and a pipe read to its end ([`TailCollector`]).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Each tail is at most 1 MiB, truncation marker included.
pub const TAIL_LIMIT_BYTES: u64 = 1024 * 1024;
/// One streamed chunk is at most 64 KiB.
pub const CHUNK_BYTES: usize = 64 * 1024;

/// Why a log file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("failed to read log file {path}")]
pub struct LogError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// The end of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    /// At most the limit, marker included.
    pub data: Vec<u8>,
    pub truncated: bool,
    /// The length of the whole stream.
    pub total_bytes: u64,
}

/// The marker line that starts a truncated tail.
pub fn truncation_marker(dropped: u64) -> String {
    format!("[kruntimes: {dropped} earlier bytes truncated]\n")
}

/// How many trailing bytes of a `total`-byte stream a tail of `limit` bytes keeps, and the
/// marker it starts with (empty when nothing is dropped).
pub fn tail_plan(total: u64, limit: u64) -> (u64, String) {
    if total <= limit {
        return (total, String::new());
    }
    // The marker for `total` dropped bytes is at least as long as the real one.
    let worst = truncation_marker(total).len() as u64;
    let keep = limit.saturating_sub(worst);
    let marker = truncation_marker(total - keep);
    (keep, marker)
}

/// Reads the last [`TAIL_LIMIT_BYTES`] of the file at `path`; a missing file is empty.
pub fn read_tail(path: &Path) -> Result<Tail, LogError> {
    read_tail_with_limit(path, TAIL_LIMIT_BYTES)
}

pub(crate) fn read_tail_with_limit(path: &Path, limit: u64) -> Result<Tail, LogError> {
    let err = |source| LogError {
        path: path.to_owned(),
        source,
    };
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Tail {
                data: Vec::new(),
                truncated: false,
                total_bytes: 0,
            });
        }
        Err(e) => return Err(err(e)),
    };
    let total = file.metadata().map_err(err)?.len();
    let (keep, marker) = tail_plan(total, limit);
    file.seek(SeekFrom::Start(total - keep)).map_err(err)?;
    let mut data = Vec::with_capacity(marker.len() + keep as usize);
    data.extend_from_slice(marker.as_bytes());
    // `take` bounds the read even if the file grows meanwhile.
    file.take(keep).read_to_end(&mut data).map_err(err)?;
    Ok(Tail {
        data,
        truncated: !marker.is_empty(),
        total_bytes: total,
    })
}

/// The end of bytes `start..end` of an open log file (what one invocation appended to it),
/// at most `limit` bytes, marker included. `total_bytes` is the span's length.
pub fn read_span_tail(file: &File, start: u64, end: u64, limit: u64) -> std::io::Result<Tail> {
    let total = end.saturating_sub(start);
    let (keep, marker) = tail_plan(total, limit);
    let mut data = Vec::with_capacity(marker.len() + keep as usize);
    data.extend_from_slice(marker.as_bytes());
    let mut offset = end - keep;
    let mut chunk = vec![0u8; keep.min(CHUNK_BYTES as u64) as usize];
    while offset < end {
        let want = (end - offset).min(chunk.len() as u64) as usize;
        let n = file.read_at(&mut chunk[..want], offset)?;
        if n == 0 {
            break; // the file shrank meanwhile
        }
        data.extend_from_slice(&chunk[..n]);
        offset += n as u64;
    }
    Ok(Tail {
        data,
        truncated: !marker.is_empty(),
        total_bytes: total,
    })
}

/// Keeps the end of a stream that arrives in pieces (a pipe), within a bound.
#[derive(Debug)]
pub struct TailCollector {
    limit: u64,
    kept: VecDeque<u8>,
    total: u64,
}

impl TailCollector {
    /// A collector whose [`TailCollector::finish`] is at most `limit` bytes, marker
    /// included.
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            kept: VecDeque::new(),
            total: 0,
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        self.total += data.len() as u64;
        // Never more than `limit` bytes: a tail keeps at most that many.
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        let data = &data[data.len().saturating_sub(limit)..];
        let overflow = (self.kept.len() + data.len()).saturating_sub(limit);
        self.kept.drain(..overflow.min(self.kept.len()));
        self.kept.extend(data);
    }

    /// The last bytes of the stream, behind the truncation marker when some were dropped.
    pub fn finish(self) -> Tail {
        let (keep, marker) = tail_plan(self.total, self.limit);
        let skip = self.kept.len() - keep as usize;
        let mut data = Vec::with_capacity(marker.len() + keep as usize);
        data.extend_from_slice(marker.as_bytes());
        data.extend(self.kept.iter().skip(skip));
        Tail {
            data,
            truncated: !marker.is_empty(),
            total_bytes: self.total,
        }
    }
}

/// Reads at most [`CHUNK_BYTES`] from `offset`; empty at the end of the file or when the
/// file does not exist yet.
pub fn read_chunk(path: &Path, offset: u64) -> Result<Vec<u8>, LogError> {
    let err = |source| LogError {
        path: path.to_owned(),
        source,
    };
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(err(e)),
    };
    file.seek(SeekFrom::Start(offset)).map_err(err)?;
    let mut data = Vec::with_capacity(CHUNK_BYTES);
    file.take(CHUNK_BYTES as u64)
        .read_to_end(&mut data)
        .map_err(err)?;
    Ok(data)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn short_stream_is_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        std::fs::write(&path, b"hello\n").unwrap();
        let tail = read_tail_with_limit(&path, 100).unwrap();
        assert_eq!(tail.data, b"hello\n");
        assert!(!tail.truncated);
        assert_eq!(tail.total_bytes, 6);
    }

    #[test]
    fn long_stream_keeps_the_end_behind_a_marker_within_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let body: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &body).unwrap();
        for limit in [60u64, 100, 1000, 9_999] {
            let tail = read_tail_with_limit(&path, limit).unwrap();
            assert!(tail.truncated);
            assert!(tail.data.len() as u64 <= limit, "limit {limit}");
            let text = String::from_utf8_lossy(&tail.data);
            let marker_end = tail.data.iter().position(|b| *b == b'\n').unwrap() + 1;
            let kept = &tail.data[marker_end..];
            assert!(body.ends_with(kept));
            let dropped = body.len() - kept.len();
            assert!(
                text.starts_with(&truncation_marker(dropped as u64)),
                "{text}"
            );
        }
    }

    #[test]
    fn span_tail_covers_only_the_span() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        std::fs::write(&path, b"before|during the call|after").unwrap();
        let file = File::open(&path).unwrap();
        let tail = read_span_tail(&file, 7, 22, 100).unwrap();
        assert_eq!(tail.data, b"during the call");
        assert_eq!(tail.total_bytes, 15);
        assert!(!tail.truncated);
        let long_path = dir.path().join("long");
        let mut long = b"before|".to_vec();
        long.extend_from_slice(&[b'x'; 100]);
        long.extend_from_slice(b"the end|after");
        std::fs::write(&long_path, &long).unwrap();
        let long_file = File::open(&long_path).unwrap();
        let end = long.len() as u64 - 6;
        let tail = read_span_tail(&long_file, 7, end, 60).unwrap();
        assert!(tail.truncated);
        assert!(tail.data.len() <= 60);
        assert!(tail.data.starts_with(b"[kruntimes: "));
        assert!(tail.data.ends_with(b"xxthe end"));
        assert_eq!(tail.total_bytes, end - 7);
        let empty = read_span_tail(&file, 5, 5, 100).unwrap();
        assert_eq!(empty.total_bytes, 0);
        assert!(empty.data.is_empty());
    }

    #[test]
    fn collector_keeps_the_end_of_a_piecewise_stream() {
        let mut whole = Vec::new();
        let mut collector = TailCollector::new(64);
        for i in 0..50u8 {
            let piece = vec![b'a' + (i % 26); usize::from(i % 7)];
            whole.extend_from_slice(&piece);
            collector.push(&piece);
        }
        let tail = collector.finish();
        assert_eq!(tail.total_bytes, whole.len() as u64);
        assert!(tail.truncated);
        assert!(tail.data.len() <= 64);
        let marker_end = tail.data.iter().position(|b| *b == b'\n').unwrap() + 1;
        let kept = &tail.data[marker_end..];
        assert!(whole.ends_with(kept));
        assert_eq!(
            &tail.data[..marker_end],
            truncation_marker((whole.len() - kept.len()) as u64).as_bytes()
        );
        let mut short = TailCollector::new(64);
        short.push(b"abc");
        short.push(b"");
        assert_eq!(short.finish().data, b"abc");
    }

    #[test]
    fn missing_file_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let tail = read_tail(&dir.path().join("none")).unwrap();
        assert_eq!(tail.total_bytes, 0);
        assert!(read_chunk(&dir.path().join("none"), 0).unwrap().is_empty());
    }

    #[test]
    fn chunks_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        std::fs::write(&path, vec![b'x'; CHUNK_BYTES + 10]).unwrap();
        assert_eq!(read_chunk(&path, 0).unwrap().len(), CHUNK_BYTES);
        assert_eq!(read_chunk(&path, CHUNK_BYTES as u64).unwrap().len(), 10);
        assert!(
            read_chunk(&path, CHUNK_BYTES as u64 + 10)
                .unwrap()
                .is_empty()
        );
    }
}
