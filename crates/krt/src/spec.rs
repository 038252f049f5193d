//! Building a task Run from `krt run` arguments: the program, its environment and timeout.
//! Pure functions, so every rule is unit-tested.

use std::path::Path;

use anyhow::{Result, bail};
use kruntimes_api::run::{EnvVar, MAX_ENV_VARS, MAX_INLINE_SOURCE_BYTES, MAX_TASK_ARGS, RunSource};
use kruntimes_api::{Run, RunSpec};
use kube::api::ObjectMeta;

/// What to run, from `--file F [-- ARGS…]` or `-- ARGV…`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    pub entrypoint: String,
    pub args: Vec<String>,
    pub inline: Option<String>,
}

/// The text of a local file sent as inline source: at most 256 KiB of UTF-8.
pub fn source_from_file(path: &Path, contents: Vec<u8>) -> Result<String> {
    if contents.len() > MAX_INLINE_SOURCE_BYTES {
        bail!(
            "{} is {} bytes; inline source is at most {} KiB",
            path.display(),
            contents.len(),
            MAX_INLINE_SOURCE_BYTES / 1024
        );
    }
    let Ok(text) = String::from_utf8(contents) else {
        bail!(
            "{} is not UTF-8 text; inline source must be text",
            path.display()
        );
    };
    Ok(text)
}

/// `--file F`: the file's contents become the inline source and its base name the
/// entrypoint, which the runtime server's interpreter runs; trailing ARGV become its args.
pub fn program_from_file(path: &Path, contents: Vec<u8>, args: Vec<String>) -> Result<Program> {
    let text = source_from_file(path, contents)?;
    let Some(base) = path.file_name().and_then(|n| n.to_str()) else {
        bail!(
            "{} has no file name usable as an entrypoint",
            path.display()
        );
    };
    if base.is_empty() || base == "." || base == ".." {
        bail!(
            "{} has no file name usable as an entrypoint",
            path.display()
        );
    }
    check_args(&args)?;
    Ok(Program {
        entrypoint: base.to_string(),
        args,
        inline: Some(text),
    })
}

/// `-- ARGV…`: ARGV[0] is the entrypoint (a program name the runtime resolves), the rest
/// its args.
pub fn program_from_argv(argv: Vec<String>) -> Result<Program> {
    let mut argv = argv.into_iter();
    let Some(entrypoint) = argv.next() else {
        bail!(
            "nothing to run: pass --file PATH, or a command after `--` (e.g. `krt run --runtime python -- python3 -c 'print(1)'`)"
        );
    };
    if entrypoint.is_empty() {
        bail!("the command after `--` is empty");
    }
    if entrypoint.contains('/') {
        bail!(
            "the command {entrypoint:?} must be a program name without '/' (it runs on the \
             worker, not here); to run a local file pass --file {entrypoint}"
        );
    }
    let args: Vec<String> = argv.collect();
    check_args(&args)?;
    Ok(Program {
        entrypoint,
        args,
        inline: None,
    })
}

fn check_args(args: &[String]) -> Result<()> {
    if args.len() > MAX_TASK_ARGS {
        bail!("{} arguments; at most {MAX_TASK_ARGS}", args.len());
    }
    Ok(())
}

fn is_env_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 256
        && !bytes[0].is_ascii_digit()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'_')
}

/// Parses `--env` values. `K=V` sets K to V (V may contain `=` or be empty); a bare `K`
/// takes K's value from krt's own environment, like `docker run -e K`. A name given twice
/// keeps its last value, in the position of its first.
pub fn parse_env(
    values: &[String],
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<EnvVar>> {
    let mut vars: Vec<EnvVar> = Vec::new();
    for value in values {
        let (name, value) = match value.split_once('=') {
            Some((name, value)) => (name, value.to_string()),
            None => match lookup(value) {
                Some(v) => (value.as_str(), v),
                None => bail!(
                    "--env {value}: {value} is not set here; write --env {value}=VALUE to set it"
                ),
            },
        };
        if !is_env_name(name) {
            bail!(
                "--env {name:?}: a variable name is letters, digits and '_', not starting with a digit"
            );
        }
        if name.starts_with("KRUNTIME_") {
            bail!("--env {name}: names starting with KRUNTIME_ are reserved");
        }
        match vars.iter_mut().find(|v| v.name == name) {
            Some(existing) => existing.value = value,
            None => vars.push(EnvVar {
                name: name.to_string(),
                value,
            }),
        }
    }
    if vars.len() > MAX_ENV_VARS {
        bail!(
            "{} environment variables; at most {MAX_ENV_VARS}",
            vars.len()
        );
    }
    Ok(vars)
}

/// Parses a duration such as `90s`, `5m`, `1h30m`, `250ms`; it must be positive.
pub fn parse_timeout(flag: &str, text: &str) -> Result<std::time::Duration> {
    match kruntimes_api::duration::parse(text) {
        Ok(d) if d.is_zero() => bail!("{flag} must be greater than zero"),
        Ok(d) => Ok(d),
        Err(e) => bail!("{flag} {text:?}: {e}"),
    }
}

/// The Run object for `krt run`.
pub fn build_run(
    runtime: &str,
    name: Option<&str>,
    program: Program,
    env: Vec<EnvVar>,
    timeout: Option<&str>,
) -> Run {
    let mut spec = RunSpec::task(runtime, program.entrypoint);
    if let Some(task) = spec.mode.task.as_mut() {
        task.args = program.args;
    }
    spec.source = program.inline.map(|inline| RunSource {
        inline: Some(inline),
        snapshot: None,
    });
    if !env.is_empty() {
        spec.env = Some(env);
    }
    spec.timeout = timeout.map(str::to_string);
    let metadata = match name {
        Some(name) => ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        },
        None => ObjectMeta {
            generate_name: Some(format!("{runtime}-")),
            ..ObjectMeta::default()
        },
    };
    Run {
        metadata,
        spec,
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn file_becomes_inline_source_named_after_its_base_name() {
        let p = program_from_file(
            Path::new("some/dir/script.py"),
            b"print(1)\n".to_vec(),
            vec!["a".into()],
        )
        .expect("ok");
        assert_eq!(p.entrypoint, "script.py");
        assert_eq!(p.inline.as_deref(), Some("print(1)\n"));
        assert_eq!(p.args, vec!["a".to_string()]);
    }

    #[test]
    fn file_over_256_kib_is_refused() {
        let ok = program_from_file(
            Path::new("a.py"),
            vec![b'x'; MAX_INLINE_SOURCE_BYTES],
            vec![],
        );
        assert!(ok.is_ok());
        let e = program_from_file(
            Path::new("a.py"),
            vec![b'x'; MAX_INLINE_SOURCE_BYTES + 1],
            vec![],
        )
        .expect_err("too big");
        assert!(e.to_string().contains("256 KiB"), "{e}");
    }

    #[test]
    fn file_must_be_text() {
        let e =
            program_from_file(Path::new("a.bin"), vec![0xff, 0xfe], vec![]).expect_err("binary");
        assert!(e.to_string().contains("UTF-8"), "{e}");
    }

    #[test]
    fn argv_gives_entrypoint_and_args() {
        let p =
            program_from_argv(vec!["python3".into(), "-c".into(), "print(1)".into()]).expect("ok");
        assert_eq!(p.entrypoint, "python3");
        assert_eq!(p.args, vec!["-c".to_string(), "print(1)".to_string()]);
        assert_eq!(p.inline, None);
    }

    #[test]
    fn argv_refuses_nothing_and_paths() {
        let e = program_from_argv(vec![]).expect_err("empty");
        assert!(e.to_string().contains("--file"), "{e}");
        let e = program_from_argv(vec!["./x.sh".into()]).expect_err("path");
        assert!(e.to_string().contains("--file ./x.sh"), "{e}");
    }

    #[test]
    fn env_pairs_parse() {
        let vars = parse_env(
            &["A=1".into(), "B=x=y".into(), "C=".into(), "A=2".into()],
            no_env,
        )
        .expect("ok");
        let got: Vec<(&str, &str)> = vars
            .iter()
            .map(|v| (v.name.as_str(), v.value.as_str()))
            .collect();
        assert_eq!(got, vec![("A", "2"), ("B", "x=y"), ("C", "")]);
    }

    #[test]
    fn bare_env_name_takes_the_local_value() {
        let vars = parse_env(&["HOME".into()], |k| {
            (k == "HOME").then(|| "/home/me".to_string())
        })
        .expect("ok");
        assert_eq!(vars[0].value, "/home/me");
        let e = parse_env(&["NOPE".into()], no_env).expect_err("unset");
        assert!(e.to_string().contains("NOPE=VALUE"), "{e}");
    }

    #[test]
    fn bad_env_names_are_refused() {
        for bad in ["=1", "1A=x", "A-B=x", "A B=x", "KRUNTIME_OUTPUTS=x"] {
            assert!(parse_env(&[bad.into()], no_env).is_err(), "{bad}");
        }
    }

    #[test]
    fn timeouts_parse() {
        assert_eq!(
            parse_timeout("--timeout", "90s").expect("ok"),
            std::time::Duration::from_secs(90)
        );
        assert_eq!(
            parse_timeout("--timeout", "1h30m").expect("ok"),
            std::time::Duration::from_secs(5400)
        );
        for bad in ["0", "", "5", "1.5s", "-1s", "1d"] {
            assert!(parse_timeout("--timeout", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn run_object_is_a_task_with_generate_name() {
        let program = program_from_argv(vec!["echo".into(), "hi".into()]).expect("ok");
        let env = parse_env(&["A=1".into()], no_env).expect("ok");
        let run = build_run("python", None, program, env, Some("10s"));
        assert_eq!(run.metadata.generate_name.as_deref(), Some("python-"));
        assert_eq!(run.metadata.name, None);
        let task = run.spec.mode.task.as_ref().expect("task");
        assert_eq!(task.entrypoint.as_deref(), Some("echo"));
        assert_eq!(task.args, vec!["hi".to_string()]);
        assert_eq!(run.spec.runtime, "python");
        assert_eq!(run.spec.timeout.as_deref(), Some("10s"));
        assert_eq!(run.spec.source, None);
        assert_eq!(run.spec.env.as_ref().map(Vec::len), Some(1));
        assert_eq!(kruntimes_api::admission::validate_create(&run.spec), vec![]);
        let value = serde_json::to_value(&run).expect("json");
        assert_eq!(value["apiVersion"], "kruntimes.io/v1alpha1");
        assert_eq!(value["kind"], "Run");
    }

    #[test]
    fn named_run_with_file() {
        let program =
            program_from_file(Path::new("main.py"), b"print(2)".to_vec(), vec![]).expect("ok");
        let run = build_run("python", Some("mine"), program, vec![], None);
        assert_eq!(run.metadata.name.as_deref(), Some("mine"));
        assert_eq!(run.metadata.generate_name, None);
        assert_eq!(
            run.spec.source.as_ref().and_then(|s| s.inline.as_deref()),
            Some("print(2)")
        );
        assert_eq!(run.spec.env, None);
        assert_eq!(kruntimes_api::admission::validate_create(&run.spec), vec![]);
    }
}
