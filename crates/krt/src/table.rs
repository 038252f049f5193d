//! Tables in the kubectl style: upper-case headers, columns padded to their widest cell,
//! three spaces apart; and kubectl's short ages (`45s`, `12m`, `3h`, `2d`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kruntimes_api::{Run, Runtime};

/// Renders `rows` under `headers`; the last column is not padded.
pub fn render(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let cells: Vec<&str> = cells.collect();
        let last = cells.len().saturating_sub(1);
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            text.push_str(cell);
            if i < last {
                let width = widths.get(i).copied().unwrap_or(0);
                let pad = width.saturating_sub(cell.chars().count());
                text.push_str(&" ".repeat(pad + 3));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// A short age like kubectl's: `45s`, `12m`, `3h`, `2d`, `1y`; `<unknown>` without a time.
pub fn age(created: Option<&Time>, now_unix: i64) -> String {
    let Some(created) = created else {
        return "<unknown>".to_string();
    };
    let secs = (now_unix - created.0.as_second()).max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 3600 * 2 => format!("{}m", s / 60),
        s if s < 86400 * 2 => format!("{}h", s / 3600),
        s if s < 86400 * 365 * 2 => format!("{}d", s / 86400),
        s => format!("{}y", s / (86400 * 365)),
    }
}

/// Seconds since the Unix epoch, now.
pub fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// `NAME RUNTIME PHASE EXIT AGE`, with NAMESPACE first when `namespaces`.
pub fn runs(runs: &[Run], namespaces: bool, now: i64) -> String {
    let mut headers = vec!["NAME", "RUNTIME", "PHASE", "EXIT", "AGE"];
    if namespaces {
        headers.insert(0, "NAMESPACE");
    }
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|run| {
            let mut row = vec![
                run.metadata.name.clone().unwrap_or_default(),
                run.spec.runtime.clone(),
                run.phase().as_str().to_string(),
                run.status
                    .as_ref()
                    .and_then(|s| s.exit_code)
                    .map(|c| c.to_string())
                    .unwrap_or_default(),
                age(run.metadata.creation_timestamp.as_ref(), now),
            ];
            if namespaces {
                row.insert(0, run.metadata.namespace.clone().unwrap_or_default());
            }
            row
        })
        .collect();
    render(&headers, &rows)
}

/// `NAME RUNTIME PHASE AGE LABELS` for sandboxes (session Runs), NAMESPACE first when
/// `namespaces`; LABELS is `k=v,k2=v2` in key order, `<none>` without.
pub fn sandboxes(runs: &[Run], namespaces: bool, now: i64) -> String {
    let mut headers = vec!["NAME", "RUNTIME", "PHASE", "AGE", "LABELS"];
    if namespaces {
        headers.insert(0, "NAMESPACE");
    }
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|run| {
            let labels = match &run.metadata.labels {
                Some(labels) if !labels.is_empty() => labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(","),
                _ => "<none>".to_string(),
            };
            let mut row = vec![
                run.metadata.name.clone().unwrap_or_default(),
                run.spec.runtime.clone(),
                run.phase().as_str().to_string(),
                age(run.metadata.creation_timestamp.as_ref(), now),
                labels,
            ];
            if namespaces {
                row.insert(0, run.metadata.namespace.clone().unwrap_or_default());
            }
            row
        })
        .collect();
    render(&headers, &rows)
}

/// `NAME RUNTIME PHASE READY ENDPOINT AGE` for function Runs: READY is the Ready
/// condition (`True` only while it accepts invocations), ENDPOINT the invoke URL.
pub fn functions(runs: &[Run], now: i64) -> String {
    let headers = ["NAME", "RUNTIME", "PHASE", "READY", "ENDPOINT", "AGE"];
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|run| {
            let status = run.status.as_ref();
            vec![
                run.metadata.name.clone().unwrap_or_default(),
                run.spec.runtime.clone(),
                run.phase().as_str().to_string(),
                if kruntimes_api::lifecycle::is_ready(status) {
                    "True"
                } else {
                    "False"
                }
                .to_string(),
                status
                    .and_then(|s| s.endpoint.as_ref())
                    .map_or_else(|| "<none>".to_string(), |e| e.url.clone()),
                age(run.metadata.creation_timestamp.as_ref(), now),
            ]
        })
        .collect();
    render(&headers, &rows)
}

/// `NAME REPLICAS READY RUNS USED AGE`: RUNS is the Run slots over the ready workers, USED
/// the slots held by active Runs.
pub fn runtimes(runtimes: &[Runtime], namespaces: bool, now: i64) -> String {
    let mut headers = vec!["NAME", "REPLICAS", "READY", "RUNS", "USED", "AGE"];
    if namespaces {
        headers.insert(0, "NAMESPACE");
    }
    let number = |n: Option<i32>| n.unwrap_or(0).to_string();
    let rows: Vec<Vec<String>> = runtimes
        .iter()
        .map(|rt| {
            let status = rt.status.as_ref();
            let mut row = vec![
                rt.metadata.name.clone().unwrap_or_default(),
                rt.spec.replicas.to_string(),
                number(status.and_then(|s| s.ready_replicas)),
                number(status.and_then(|s| s.total_runs)),
                number(status.and_then(|s| s.used_runs)),
                age(rt.metadata.creation_timestamp.as_ref(), now),
            ];
            if namespaces {
                row.insert(0, rt.metadata.namespace.clone().unwrap_or_default());
            }
            row
        })
        .collect();
    render(&headers, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruntimes_api::{Phase, RunSpec, RunStatus, RuntimeSpec, RuntimeStatus};

    fn time(unix: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(unix).expect("valid"))
    }

    #[test]
    fn ages_read_like_kubectl() {
        let now = 1_000_000_000;
        assert_eq!(age(Some(&time(now - 5)), now), "5s");
        assert_eq!(age(Some(&time(now - 119)), now), "119s");
        assert_eq!(age(Some(&time(now - 600)), now), "10m");
        assert_eq!(age(Some(&time(now - 3 * 3600)), now), "3h");
        assert_eq!(age(Some(&time(now - 3 * 86400)), now), "3d");
        assert_eq!(age(Some(&time(now + 10)), now), "0s");
        assert_eq!(age(None, now), "<unknown>");
    }

    #[test]
    fn run_table_has_the_documented_columns() {
        let mut a = Run::new("python-abc12", RunSpec::task("python", "main.py"));
        a.metadata.creation_timestamp = Some(time(100));
        a.status = Some(RunStatus {
            phase: Some(Phase::Failed),
            exit_code: Some(3),
            ..RunStatus::default()
        });
        let b = Run::new("b", RunSpec::task("bash", "x"));
        let text = runs(&[a, b], false, 130);
        assert_eq!(
            text,
            "NAME           RUNTIME   PHASE     EXIT   AGE\n\
             python-abc12   python    Failed    3      30s\n\
             b              bash      Pending          <unknown>\n"
        );
    }

    #[test]
    fn function_table_has_the_documented_columns() {
        use kruntimes_api::run::{EndpointProtocol, RunEndpoint};
        let mut ready = Run::new("greeter", RunSpec::task("python", "x"));
        ready.metadata.creation_timestamp = Some(time(100));
        let mut status = RunStatus {
            phase: Some(Phase::Ready),
            endpoint: Some(RunEndpoint {
                protocol: EndpointProtocol::Https,
                url: "https://gw/f/u:invoke".into(),
                ca_bundle: None,
            }),
            ..RunStatus::default()
        };
        kruntimes_api::lifecycle::set_ready(&mut status, true, "FunctionRegistered", "", None);
        ready.status = Some(status);
        let pending = Run::new("later", RunSpec::task("bash", "x"));
        assert_eq!(
            functions(&[ready, pending], 110),
            "NAME      RUNTIME   PHASE     READY   ENDPOINT                AGE\n\
             greeter   python    Ready     True    https://gw/f/u:invoke   10s\n\
             later     bash      Pending   False   <none>                  <unknown>\n"
        );
    }

    #[test]
    fn runtime_table_has_the_documented_columns() {
        let mut rt = Runtime::new(
            "python",
            RuntimeSpec {
                replicas: 2,
                scaling: None,
                runs: Some(4),
                template: Default::default(),
                port: None,
                artifact_store: None,
            },
        );
        rt.metadata.namespace = Some("team".into());
        rt.status = Some(RuntimeStatus {
            ready_replicas: Some(2),
            total_runs: Some(8),
            used_runs: Some(3),
            conditions: vec![],
            ..RuntimeStatus::default()
        });
        let text = runtimes(&[rt], true, 0);
        assert_eq!(
            text,
            "NAMESPACE   NAME     REPLICAS   READY   RUNS   USED   AGE\n\
             team        python   2          2       8      3      <unknown>\n"
        );
    }
}
